"""Jinja2 environments for bundle templates, one per target folder in `moeplan.templates`.

Strict (a missing value is an error, not an empty string) and with quoting filters that render
user-controlled values (model names, images) as JSON literals: valid YAML flow scalars and inert
one-line text in shell comments, so no name can inject structure into a template.
"""
from __future__ import annotations

import json
from importlib import resources

import jinja2


def to_yaml(value) -> str:
    """A YAML flow value for anything JSON can hold: quoting and escaping are JSON's."""
    return json.dumps(value, ensure_ascii=True, sort_keys=True)


def template_env(target: str) -> jinja2.Environment:
    """The environment for `templates/<target>/`, with filters `y` (any value) and `oneline` (text)."""
    root = resources.files("moeplan.templates") / target
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(root)), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, autoescape=False)
    env.filters["y"] = to_yaml
    env.filters["oneline"] = lambda value: to_yaml(str(value))
    return env
