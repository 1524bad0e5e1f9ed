"""The ``mm`` command: train, check, data, plugins, convert.

User errors print one line and exit with status 2."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from mm_core.train.entry import EXIT_USER_ERROR, guarded, report_error, run_worker, traceback_tail


def _cmd_train(args: argparse.Namespace) -> int:
    argv = [args.config, *args.overrides]
    in_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if args.nproc_per_node is None or in_torchrun:
        return run_worker(argv)

    def precheck() -> None:
        from mm_core.check import run_check
        from mm_core.config import load_config

        run_check(load_config(args.config, args.overrides), args.nproc_per_node, quiet=True)

    try:
        code = guarded(precheck)
    except Exception as exc:  # noqa: BLE001 - a crash in a plugin while checking: printed like a worker's
        print(traceback_tail(exc), file=sys.stderr)
        print(
            f"mm: the check before starting the workers failed: {type(exc).__name__}: {exc}", file=sys.stderr
        )
        return 1
    if code:
        return code
    from mm_core.launch import launch_local

    return launch_local(args.nproc_per_node, argv, max_restarts=args.max_restarts)


def _cmd_check(args: argparse.Namespace) -> int:
    def go() -> None:
        from mm_core.check import run_check
        from mm_core.config import load_config

        cfg = load_config(args.config, args.overrides)
        if args.simulate:
            from mm_core.simulate import run_simulation

            run_simulation(cfg, args.world_size, args.device_memory, as_json=args.json)
            return
        run_check(cfg, args.world_size, probe_grads=args.grad_probe, as_json=args.json)

    return guarded(go)


def _cmd_data(args: argparse.Namespace) -> int:
    verified = True

    def go() -> None:
        nonlocal verified
        from mm_core.config import load_config
        from mm_core.data.prepare import prepare_data, verify_data

        cfg = load_config(args.config, args.overrides)
        if args.action == "prepare":
            prepare_data(cfg, workers=args.workers, overwrite=args.overwrite)
        else:
            verified = verify_data(cfg)

    code = guarded(go)
    return code or (0 if verified else 1)


def _cmd_plugins(args: argparse.Namespace) -> int:
    from mm_core.registry import REGISTRIES

    rows = [(i.kind, i.name, i.provider, i.target) for reg in REGISTRIES for i in reg.infos()]
    if not rows:
        print("no plugins installed")
        return 0
    widths = [max(len(r[c]) for r in rows + [("kind", "name", "provided by", "target")]) for c in range(4)]
    for row in [("kind", "name", "provided by", "target"), *rows]:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    def go() -> None:
        from mm_core import convert

        if args.direction == "hf-to-dcp":
            out = convert.hf_to_dcp(args.src, args.dst)
        else:
            out = convert.dcp_to_hf(
                args.src,
                args.dst,
                max_shard_size=args.max_shard_size,
                plugins=args.plugin,
                trust_remote_code=args.trust_remote_code,
                allow_nonfinite=args.allow_nonfinite,
            )
        print(f"wrote {out}")

    return guarded(go)


def build_parsers() -> dict[str, argparse.ArgumentParser]:
    """One parser per subcommand (each parsed with intermixed options and positionals)."""
    parsers: dict[str, argparse.ArgumentParser] = {}

    def add(name: str, help_text: str, func: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(prog=f"mm {name}", description=help_text)
        p.set_defaults(func=func)
        parsers[name] = p
        return p

    p = add("train", "train from a YAML config", _cmd_train)
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. training.lr=3e-4")
    p.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        type=int,
        default=None,
        help="launch this many local worker processes (outside torchrun)",
    )
    p.add_argument(
        "--max-restarts",
        "--max_restarts",
        type=int,
        default=0,
        help="with --nproc-per-node: restart all workers up to this many times after a failure "
        "(use with training.load=auto to resume from the last checkpoint)",
    )

    p = add("check", "validate a config and print the resolved plan without training", _cmd_check)
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--world-size", type=int, default=1, help="world size to check the layout for")
    p.add_argument(
        "--json",
        action="store_true",
        help="print the resolved build plan, parameter counts and memory estimate as one JSON object",
    )
    p.add_argument(
        "--simulate",
        action="store_true",
        help="build one rank of a --world-size run at the model's real size on the meta device, over torch's "
        "fake process group (no other process, no memory), and count the bytes that rank holds",
    )
    p.add_argument(
        "--device-memory",
        type=float,
        default=64.0,
        metavar="GiB",
        help="with --simulate: the device memory the total must fit in (64: Ascend 910B, 80: H100, "
        "141: H200)",
    )
    p.add_argument(
        "--grad-probe",
        action="store_true",
        help="also build the model on CPU, run one micro-batch forward and backward and list the trainable "
        "parameters that get no gradient (costs what the model costs; shrink it with model.config_overrides)",
    )

    p = add("data", "prepare a config's dataset ahead of training (tokenise once), or verify it", _cmd_data)
    p.add_argument("action", choices=["prepare", "verify"])
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--workers", type=int, default=None, help="prepare: local processes (default: every CPU)")
    p.add_argument("--overwrite", action="store_true", help="prepare: rebuild even when the cache is current")

    add("plugins", "list installed models, datasets, collators and optimizers", _cmd_plugins)

    p = add("convert", "convert weights between Hugging Face folders and DCP checkpoints", _cmd_convert)
    p.add_argument("direction", choices=["hf-to-dcp", "dcp-to-hf"])
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--max-shard-size", default="5GB", help="dcp-to-hf: largest safetensors file")
    p.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="MODULE",
        help="dcp-to-hf: import this module (repeatable) to register the model; modules named inside the "
        "checkpoint are never imported",
    )
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="dcp-to-hf: allow building a model whose code lives in its model_name_or_path folder",
    )
    p.add_argument(
        "--allow-nonfinite",
        action="store_true",
        help="dcp-to-hf: export even when the weights hold NaN or inf (refused by default)",
    )
    return parsers


def _usage(parsers: dict[str, argparse.ArgumentParser]) -> str:
    lines = ["usage: mm {" + ",".join(parsers) + "} ...", "", "commands:"]
    lines += [f"  {name:<9} {p.description}" for name, p in parsers.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parsers = build_parsers()
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage(parsers))
        return 0 if argv else EXIT_USER_ERROR
    if argv[0] not in parsers:
        print(_usage(parsers), file=sys.stderr)
        return report_error(f"unknown command {argv[0]!r}")
    args = parsers[argv[0]].parse_intermixed_args(argv[1:])
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
