"""The Step Functions definition (Amazon States Language) that generates one request's tokens.

Why generated from the plan: the order is the model's (dense parts of segment 0, MoE layer 0,
segment 1, ...), and each MoE layer's scatter-gather method decides its states. S3 methods: the
dense function that routed the layer wrote each active replica's rows to S3 and returns
`active`; a Parallel state holds one branch per expert replica, each a Choice that invokes the
replica only if it is named in `active` (ResultPath null: the state passes through unchanged).
Direct method: no state; the routing function invoked the replicas itself. Function ARNs are
`${LogicalId}` placeholders filled by DefinitionSubstitutions.

One execution is the whole generation: a dense task hands the execution's state to its function
(`Payload.state`) and the function's answer becomes the next state (OutputPath `$.Payload`); after
the function that computes the logits, a Choice loops back to the first state for the next token
until the state says `done` (`runtime/lambda_/decode.py`). The first step is the prompt's forward,
every later one a single token per sequence attending to the K/V the functions kept.
"""
from __future__ import annotations

INVOKE = "arn:aws:states:::lambda:invoke"


NEXT_TOKEN, DONE = "Next token", "Done"


def _task(function: str, payload: dict, nxt, keep_state: bool) -> dict:
    state = {"Type": "Task", "Resource": INVOKE,
             "Parameters": {"FunctionName": "${" + function + "}", "Payload": payload},
             "Retry": [{"ErrorEquals": ["Lambda.ServiceException", "Lambda.TooManyRequestsException"],
                        "IntervalSeconds": 1, "MaxAttempts": 3, "BackoffRate": 2}]}
    if keep_state:
        state["ResultPath"] = None
    else:
        state["OutputPath"] = "$.Payload"
    return _link(state, nxt)


def _link(state: dict, nxt) -> dict:
    if nxt is None:
        state["End"] = True
    else:
        state["Next"] = nxt
    return state


def definition(steps: list) -> dict:
    """`steps`: ("dense", logical id, segment) or ("moe", layer, [(tag, logical id)]) in run order."""
    names = []
    for step in steps:
        names.append(f"Segment {step[2]}: {step[1]}" if step[0] == "dense" else f"MoE layer {step[1]}")
    states = {}
    for k, step in enumerate(steps):
        nxt = names[k + 1] if k + 1 < len(steps) else NEXT_TOKEN
        if step[0] == "dense":
            states[names[k]] = _task(step[1], {"state.$": "$", "segment": int(step[2])}, nxt, keep_state=False)
            continue
        branches = []
        for tag, function in step[2]:
            run, skip, check = f"Run {tag}", f"Skip {tag}", f"Has {tag}"
            branches.append({"StartAt": check, "States": {
                check: {"Type": "Choice", "Choices": [{"Variable": f"$.active.{tag}", "IsPresent": True, "Next": run}],
                        "Default": skip},
                run: _task(function, {"request.$": "$.request", "step.$": "$.step"}, None, keep_state=True),
                skip: {"Type": "Pass", "End": True},
            }})
        states[names[k]] = _link({"Type": "Parallel", "Branches": branches, "ResultPath": None}, nxt)
    states[NEXT_TOKEN] = {"Type": "Choice", "Choices": [{"Variable": "$.done", "BooleanEquals": True, "Next": DONE}],
                          "Default": names[0]}
    states[DONE] = {"Type": "Succeed"}
    return {"Comment": "moeplan: a request's tokens, each step through the dense slices and expert functions",
            "StartAt": names[0], "States": states}
