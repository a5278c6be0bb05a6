"""Stage rules: parameter names and shapes -> stages. The one rule the torch and ONNX imports share.

Both importers see the same thing, the model's parameters by fully qualified name (torch module
paths; ONNX initializer names keep them) with shapes and dtypes. Deriving stages from that alone,
in one place, is what makes a torch import and an ONNX import of the same model equal.

The rule, applied to the parameters in the order given (torch: `named_parameters()`, which is
registration order; a torch.onnx export keeps it in its initializer list):

1. **MoE blocks, by structure** (shallowest module path first; a match claims its whole subtree).
   A module path P is an MoE block when two of its children are
   * an *expert container* X with E >= 2 experts: either a list of identical modules
     (`P.X.0.*` ... `P.X.<E-1>.*`, same names and shapes under every index, e.g. TinyMoE's
     `experts` ModuleList) or fused stacked weights (every parameter under `P.X` has leading
     dimension E and at least one is 3-D, e.g. HF `gate_up_proj` [E, 2I, D]);
   * a *router* R: exactly one parameter under `P.R` is a 2-D weight [E, D] whose D appears
     among the experts' dimensions; any other holds at most E elements (a bias, a score
     correction).
   Ties prefer an expert container whose name says `expert` but not `shared`, and a router named
   `gate`/`router`. Sibling containers with the same E and router hold slices of the same experts
   (JetMoE's `input_linear` and `output_linear`) and count as routed experts together. Failing
   both forms, a container named `expert*` of 2-D weights [E x F, D] beside a router [E, D] holds
   *flattened* experts (DBRX's `experts.mlp.w1/v1/w2`). Everything else under P (shared experts,
   their gates, an output bias) is the shared part; shared experts are counted from its weight
   matrices only.
   An MoE block inside an attention module (a mixture of attention heads, JetMoE's MoA) is no MoE
   layer: it stays in its attention stage, which records the heads a token does not use
   (`inactive_params`: (E - k) x one head's parameters).
2. **Dense stages, by name.** The remaining parameters are classified by the outermost component
   of their path that names a kind, checked per component in this order:
   norm (`norm`, `ln_*`), embedding (`embed`, `wte`, `wpe`), head (`lm_head`, `head`, `output`,
   `classifier`, `score`, `*_head`), attention (`attn`, `attention`), mlp (`mlp`, `ffn`,
   `feed_forward`). The stage is the path up to and including that component. A parameter no
   component classifies forms an `other` stage named by its module path.
3. **Order**: stages appear in the order of their first parameter. The torch importer then
   sorts them into forward order read from the model code (`forward_order.py`); for models whose
   registration order is their forward order (TinyMoE) the two agree, and an ONNX importer gets
   the same order from initializers listed in registration order or by first use in the graph.

Figures (`build_model_ir`): params and bytes from shapes x dtype sizes (or a quantized weight's
stored bits, `Param.bits`), tied aliases counted once
(under the parameter they alias) but still charged FLOPs where they are used (a tied head
multiplies through the embedding matrix); a stage's dtype is the dtype holding most of its
elements; FLOPs and activation bytes follow `core/stage_costs.py`. An MoE stage's expert figures are
one routed expert's (container / E); its shared-expert count is the number of modules in a shared
list, else the shared parameters divided by one expert's (rounded; DeepSeek's fused shared MLP of
width n x I counts n), at least 1. Hidden size = the first embedding's width (else the first
router's D); vocabulary = the head's rows (else the first embedding's). A layer whose top-k
exceeds its experts is a UserError.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from collections.abc import Iterable, Mapping, Sequence

from moeplan.core.stage_costs import (
    activation_bytes_per_token,
    dense_flops_per_token,
    moe_flops_per_token,
)
from moeplan.core.errors import UserError
from moeplan.core.ir import DenseStage, ModelIR, MoEStage, dtype_bytes


@dataclass(frozen=True)
class Param:
    """One named parameter. `tied_to` names the parameter it aliases (then it owns no storage).

    `bits` is the stored size per element when the checkpoint stores it other than as `dtype`
    (quantized weights, scales included; `quantization.py`); 0 means `dtype`'s size.
    """

    name: str
    shape: tuple
    dtype: str = "float32"
    tied_to: str = ""
    bits: float = 0.0

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= int(d)
        return n

    @property
    def owned_numel(self) -> int:
        return 0 if self.tied_to else self.numel

    @property
    def owned_bytes(self) -> float:
        per_element = self.bits / 8 if self.bits else dtype_bytes(self.dtype)
        return self.owned_numel * per_element


@dataclass(frozen=True)
class StageGroup:
    """The parameters of one stage, before figures are computed. MoE groups name their parts."""

    name: str
    kind: str
    params: tuple
    router: str = ""  # MoE only: module path of the router
    experts: str = ""  # MoE only: module path of the routed-expert container
    num_experts: int = 0
    shared_list_len: int = 0  # MoE only: modules in a shared-expert list, 0 if none is a list
    more_experts: tuple = ()  # MoE only: further sibling containers of the same experts (JetMoE)
    attention_experts: tuple = ()  # attention only: the routed head groups inside it (MoE groups)

    @property
    def is_moe(self) -> bool:
        return self.kind == "moe"

    def part(self, path: str) -> tuple:
        prefix = path + "."
        return tuple(p for p in self.params if p.name.startswith(prefix))

    def expert_part(self) -> tuple:
        """The routed experts' parameters, over every container that holds a slice of them."""
        return tuple(p for path in (self.experts, *self.more_experts) for p in self.part(path))


_DENSE_KIND_RULES = (
    ("norm", re.compile(r"norm|^ln(_|\d|$)|_ln(_|\d|$)")),
    ("embedding", re.compile(r"embed|^wte$|^wpe$")),
    ("head", re.compile(r"^(lm_head|head|output|classifier|score)$|_head$")),
    ("attention", re.compile(r"attn|attention")),
    ("mlp", re.compile(r"mlp|ffn|feed_?forward")),
)


def _as_param(item) -> Param:
    if isinstance(item, Param):
        return item
    name, shape, *rest = item
    return Param(name, tuple(int(d) for d in shape), *rest)


def _children(prefix: str, params: Sequence[Param]) -> dict:
    """Child component name -> [(path below the child, param)], in first-appearance order."""
    out: dict = {}
    cut = len(prefix) + 1 if prefix else 0
    for p in params:
        child, _, rest = p.name[cut:].partition(".")
        if rest:
            out.setdefault(child, []).append((rest, p))
    return out


def _listed_experts(entries) -> int:
    """E if entries are `<i>.<same names/shapes>` for i in 0..E-1 with E >= 2, else 0."""
    signatures: dict = {}
    for rest, p in entries:
        index, _, below = rest.partition(".")
        if not index.isdigit() or not below:
            return 0
        signatures.setdefault(int(index), []).append((below, p.shape))
    count = len(signatures)
    if count < 2 or sorted(signatures) != list(range(count)):
        return 0
    first = sorted(signatures[0])
    return count if all(sorted(s) == first for s in signatures.values()) else 0


def _fused_experts(entries) -> int:
    """E if every parameter has leading dimension E >= 2 and one is (at least) 3-D, else 0."""
    shapes = [p.shape for _, p in entries]
    if not all(len(s) >= 2 for s in shapes) or not any(len(s) >= 3 for s in shapes):
        return 0
    leading = {s[0] for s in shapes}
    return leading.pop() if len(leading) == 1 and shapes[0][0] >= 2 else 0


def _flattened_experts(child: str, entries, num_experts: int, hidden: int) -> bool:
    """Experts flattened into 2-D weights [E x F, D] (DBRX's `experts.mlp.w1/v1/w2`).

    Strict, because 2-D weights are everywhere: the container's name says `expert`, it holds at
    least two weights, every one 2-D with rows a multiple (>= 2) of the router's E and the
    router's hidden size D as columns.
    """
    if "expert" not in child.lower() or "shared" in child.lower() or num_experts < 2 or len(entries) < 2:
        return False
    return all(
        len(p.shape) == 2 and p.shape[1] == hidden and p.shape[0] % num_experts == 0
        and p.shape[0] >= 2 * num_experts
        for _, p in entries
    )


def _router_shape(entries) -> tuple | None:
    """(E, D) of a child that is one 2-D weight [E, D] plus at most E-element tensors, else None."""
    weights = [p for _, p in entries if len(p.shape) == 2]
    if len(weights) != 1 or weights[0].shape[0] < 2:
        return None
    rows = weights[0].shape[0]
    if any(p is not weights[0] and p.numel > rows for _, p in entries):
        return None
    return weights[0].shape


def _is_router(entries, num_experts: int, expert_dims: set) -> bool:
    """A weight [E, D] with D an expert dimension; anything else at most E elements (biases)."""
    weights = [p for _, p in entries if len(p.shape) == 2 and p.shape[0] == num_experts and p.shape[1] in expert_dims]
    if len(weights) != 1:
        return False
    return all(p is weights[0] or p.numel <= num_experts for _, p in entries)


def _prefer(names: list, good: tuple, bad: tuple = ()) -> str:
    for n in names:
        low = n.lower()
        if any(g in low for g in good) and not any(b in low for b in bad):
            return n
    return names[0]


def _match_moe(prefix: str, params: Sequence[Param]) -> StageGroup | None:
    children = _children(prefix, params)
    if len(children) < 2:
        return None
    candidates = []
    for child, entries in children.items():
        count = _listed_experts(entries) or _fused_experts(entries)
        if count:
            candidates.append((child, count))
    matches = {}
    for child, count in candidates:
        dims = {d for _, p in children[child] for d in p.shape[1:]}
        routers = [r for r in children if r != child and _is_router(children[r], count, dims)]
        if routers:
            matches[child] = (count, _prefer(routers, ("gate", "router")))
    if not matches:
        for router, entries in children.items():
            shape = _router_shape(entries)
            if shape is None:
                continue
            for child, expert_entries in children.items():
                if child != router and _flattened_experts(child, expert_entries, shape[0], shape[1]):
                    matches[child] = (shape[0], router)
    if not matches:
        return None
    experts = _prefer(list(matches), ("expert",), ("shared",))
    count, router = matches[experts]
    more = tuple(
        c for c, (n, r) in matches.items() if c != experts and n == count and r == router and "shared" not in c.lower()
    )
    shared_lists = [
        _listed_experts(entries) for child, entries in children.items() if child not in (experts, router, *more)
    ]
    join = (lambda c: f"{prefix}.{c}") if prefix else (lambda c: c)
    return StageGroup(
        name=prefix,
        kind="moe",
        params=tuple(params),
        router=join(router),
        experts=join(experts),
        num_experts=count,
        shared_list_len=sum(shared_lists),
        more_experts=tuple(join(c) for c in more),
    )


def _params_by_module(params: Sequence[Param]) -> dict:
    """Module path -> the parameters under it; shallowest paths first, then by first appearance."""
    under: dict = {}
    for p in params:
        parts = p.name.split(".")[:-1]
        for depth in range(1, len(parts) + 1):
            under.setdefault(".".join(parts[:depth]), []).append(p)
    return dict(sorted(under.items(), key=lambda item: item[0].count(".")))  # sorted() is stable


def _claimed_by(path: str, moe_groups: Mapping) -> str | None:
    """The MoE block path that `path` lies in (or is), if any."""
    parts = path.split(".")
    for depth in range(1, len(parts) + 1):
        prefix = ".".join(parts[:depth])
        if prefix in moe_groups:
            return prefix
    return None


def _dense_stage_of(name: str) -> tuple:
    """(stage path, kind) for a parameter outside MoE blocks, by the first component naming a kind."""
    parts = name.split(".")
    for depth, component in enumerate(parts[:-1], start=1):
        low = component.lower()
        for kind, pattern in _DENSE_KIND_RULES:
            if pattern.search(low):
                return ".".join(parts[:depth]), kind
    module = ".".join(parts[:-1])
    return (module or name), "other"


def classify_parameter_groups(params: Iterable) -> list:
    """Group parameters (`Param`s or (name, shape[, dtype[, tied_to]]) tuples) into stages.

    See the module docstring for the rule. Returns `StageGroup`s in stage order.
    """
    params = [_as_param(p) for p in params]
    moe_groups: dict = {}
    for prefix, under in _params_by_module(params).items():
        if _claimed_by(prefix, moe_groups) is None:
            group = _match_moe(prefix, under)
            if group is not None:
                moe_groups[prefix] = group

    # Routed experts inside an attention module are a mixture of attention heads (JetMoE's MoA):
    # they stay part of their attention stage, which records them to count only the k used.
    in_attention: dict = {}
    for prefix in list(moe_groups):
        path, kind = _dense_stage_of(prefix + ".x")
        if kind == "attention" and path != prefix:
            in_attention.setdefault(path, []).append(moe_groups.pop(prefix))

    order: dict = {}
    dense: dict = {}
    for p in params:
        owner = _claimed_by(p.name.rpartition(".")[0], moe_groups) if "." in p.name else None
        if owner is not None:
            key = ("moe", owner)
        else:
            path, kind = _dense_stage_of(p.name)
            key = (kind, path)
            dense.setdefault(key, []).append(p)
        order.setdefault(key, None)
    groups = []
    for kind, path in order:
        if kind == "moe":
            groups.append(moe_groups[path])
        else:
            routed = tuple(in_attention.get(path, ())) if kind == "attention" else ()
            groups.append(StageGroup(name=path, kind=kind, params=tuple(dense[(kind, path)]),
                                     attention_experts=routed))
    return groups


def _main_dtype(params: Sequence[Param]) -> str:
    counts: Counter = Counter()
    for p in params:
        counts[p.dtype] += p.numel
    return max(sorted(counts), key=lambda d: counts[d])


def _bytes(params: Sequence[Param]) -> int:
    return int(round(sum(p.owned_bytes for p in params)))


def _owned(params: Sequence[Param]) -> int:
    return sum(p.owned_numel for p in params)


def _first_2d(groups, kind: str):
    for g in groups:
        if g.kind == kind:
            for p in g.params:
                if len(p.shape) == 2:
                    return p.shape
    return None


def _shared_count(group: StageGroup, shared: Sequence[Param], expert_params: int) -> int:
    """Shared experts: the modules of a shared list, else shared weight matrices / one expert."""
    shared_params = sum(p.owned_numel for p in shared if len(p.shape) >= 2)
    if shared_params == 0:  # an output bias alone (JetMoE) is no shared expert
        return 0
    if group.shared_list_len:
        return group.shared_list_len
    return max(1, round(shared_params / expert_params)) if expert_params else 1


def _checked_top_k(group: StageGroup, top_k: Mapping[str, int]) -> int:
    """The layer's k; more experts per token than the layer has is a config mistake."""
    k = int(top_k[group.name])
    if k > group.num_experts:
        raise UserError(
            f"MoE layer {group.name!r} picks {k} experts per token but has only {group.num_experts}; "
            "fix the config's experts-per-token (num_experts_per_tok / top_k) or its number of experts"
        )
    return k


def build_model_ir(
    groups: Sequence[StageGroup],
    *,
    name: str,
    architecture: str,
    top_k: Mapping[str, int],
    hidden_size: int | None = None,
    vocab_size: int | None = None,
    source_format: str = "",
    sources: Mapping[str, str] | None = None,
    quantization: str = "",
) -> ModelIR:
    """Compute every stage's figures from its parameters. `top_k` maps MoE stage name -> k."""
    sources = sources or {}
    if hidden_size is None:
        emb = _first_2d(groups, "embedding")
        router = next((g.part(g.router) for g in groups if g.is_moe), ())
        router_w = next((p.shape for p in router if len(p.shape) == 2), None)
        hidden_size = emb[1] if emb else (router_w[1] if router_w else 0)
    if vocab_size is None:
        head = _first_2d(groups, "head") or _first_2d(groups, "embedding")
        vocab_size = head[0] if head else 0
    all_params = [p for g in groups for p in g.params]
    stages = []
    moe_index = 0
    for g in groups:
        dtype = _main_dtype(g.params)
        source = sources.get(g.name, g.name)
        if not g.is_moe:
            params = _owned(g.params)
            inactive = 0
            for inner in g.attention_experts:
                k = _checked_top_k(inner, top_k)
                inactive += (inner.num_experts - k) * (_owned(inner.expert_part()) // inner.num_experts)
            used = sum(p.numel for p in g.params) - inactive
            stages.append(DenseStage(
                name=g.name,
                kind=g.kind,
                params=params,
                param_bytes=_bytes(g.params),
                flops_per_token=dense_flops_per_token(g.kind, used, hidden_size),
                activation_bytes_per_token=activation_bytes_per_token(g.kind, hidden_size, vocab_size, dtype),
                dtype=dtype,
                source=source,
                inactive_params=inactive,
            ))
            continue
        router = g.part(g.router)
        experts = g.expert_part()
        params = _owned(g.params)
        router_params = _owned(router)
        expert_total = _owned(experts)
        expert_params = expert_total // g.num_experts
        shared_params = params - router_params - expert_total
        expert_names = {p.name for p in experts} | {p.name for p in router}
        shared = [p for p in g.params if p.name not in expert_names]
        k = _checked_top_k(g, top_k)
        stage_hidden = next(p.shape[1] for p in router if len(p.shape) == 2)
        stages.append(MoEStage(
            name=g.name,
            moe_index=moe_index,
            params=params,
            param_bytes=_bytes(g.params),
            flops_per_token=moe_flops_per_token(router_params, expert_params, k, shared_params),
            activation_bytes_per_token=activation_bytes_per_token("moe", stage_hidden, vocab_size, dtype),
            dtype=dtype,
            hidden_size=stage_hidden,
            num_experts=g.num_experts,
            top_k=k,
            expert_params=expert_params,
            expert_param_bytes=_bytes(experts) // g.num_experts,
            expert_flops_per_token=2 * expert_params,
            router_params=router_params,
            shared_experts=_shared_count(g, shared, expert_params),
            shared_expert_params=shared_params,
            source=source,
        ))
        moe_index += 1
    return ModelIR(
        name=name,
        architecture=architecture,
        hidden_size=int(hidden_size),
        vocab_size=int(vocab_size),
        dtype=_main_dtype([p for p in all_params if not p.tied_to] or all_params),
        stages=tuple(stages),
        source_format=source_format,
        quantization=quantization,
    )
