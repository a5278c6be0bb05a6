"""The sglang target: a placement SGLang loads at startup (--init-expert-location) and its launch files."""
