"""`anatomist gpus`, `anatomist models`, `anatomist env`: what anatomist knows and what this machine has."""

from __future__ import annotations

import argparse

from rich.table import Table

from anatomist.cli.common import print_json
from anatomist.cli.render import console, gib, plain_rows


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gpus", help="list the GPU catalog (and the detected GPU)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=run_gpus)
    p = sub.add_parser("models", help="list the shipped model configs")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=run_models)
    p = sub.add_parser("env", help="torch/CUDA/driver versions, bf16/tf32 support, optional packages, advice")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=run_env)


def run_gpus(args: argparse.Namespace) -> int:
    from anatomist.hardware import catalog, detect_local_gpu

    gpus = list(catalog().values())
    local = detect_local_gpu()
    if args.json:
        rows = [{**g.to_dict(), "aliases": list(g.aliases), "nvml_names": list(g.nvml_names), "source": g.source,
                 "cuda_context_source": g.cuda_context_source} for g in gpus]
        print_json({"gpus": rows, "detected": local.to_dict() if local else None})
        return 0
    table = Table(title="GPU catalog (dense peaks; sources in data/gpus.toml)", title_justify="left")
    for column in ("name", "memory", "fp32", "tf32", "fp16", "bf16", "bandwidth", "CUDA context"):
        table.add_column(column, justify="left" if column == "name" else "right")
    for g in gpus:
        table.add_row(
            g.name, gib(g.memory_bytes), f"{g.fp32_tflops:g}", f"{g.tf32_tflops:g}" if g.tf32 else "-",
            f"{g.fp16_tflops:g}", f"{g.bf16_tflops:g}" if g.bf16 else "-", f"{g.bandwidth_gbps:g} GB/s",
            gib(g.cuda_context_bytes) + (" *" if _assumed(g.cuda_context_source) else ""),
        )
    out = console()
    out.print(table)
    out.print("TFLOP/s, dense. " + (f"Detected here: {local.name}" if local else "No NVIDIA GPU detected here (NVML)."))
    if any(_assumed(g.cuda_context_source) for g in gpus):
        out.print("* CUDA context assumed, not measured on that GPU (data/gpus.toml says why)")
    return 0


def _assumed(source: str) -> bool:
    return source.startswith("assumption")


def run_models(args: argparse.Namespace) -> int:
    from anatomist.model_catalog import catalog_aliases, catalog_entries, summarize

    rows = [summarize(entry) for entry in catalog_entries().values()]
    aliases = list(catalog_aliases().values())
    if args.json:
        print_json({"models": [r.to_dict() for r in rows],
                    "aliases": [{"name": a.name, "hub_id": a.hub_id, "config": a.config, "kind": a.kind,
                                 "differs": a.differs, "source": a.source} for a in aliases]})
        return 0
    header = ["name", "Hub id", "family", "parameters", "layers", "context", "MoE"]
    cells = [[r.name, r.hub_id, r.family, _count(r.parameters),
              f"{r.layers}+{r.decoder_layers}" if r.decoder_layers is not None else str(r.layers),
              f"{r.context_length:,}" if r.context_length else "-",
              f"{r.experts_per_token}/{r.experts}" if r.is_moe else "-"] for r in rows]
    alias_header = ["alias", "config", "kind"]  # an alias is its Hub id: re-uploads share the repo name
    alias_cells = [[a.hub_id, a.config, a.kind] for a in aliases]
    out = console()
    if not out.is_terminal:  # piped or redirected: every name whole, no box drawing; the aliases after a blank line
        out.print(plain_rows(header, cells), markup=False, soft_wrap=True)
        out.print()
        out.print(plain_rows(alias_header, alias_cells), markup=False, soft_wrap=True)
        return 0
    wide = out.width >= 120  # the Hub ids fit beside the rest; in 80 columns the names come first
    out.print(_table("Model catalog (config.json only, no weights; sources in data/models)", header, cells, wide))
    out.print("parameters: as published (tied weights once); layers: encoder+decoder; MoE: experts per token/routed"
              + ("" if wide else "; Hub ids: anatomist models --json, or a wider terminal"))
    out.print(_table("Aliases: names estimated with a catalog config (sources in data/model_aliases.toml)",
                     alias_header, alias_cells, wide, pad_edge=False))  # 80 columns hold the longest Hub id
    out.print("alias: a Hub id (its name alone works too, where no other model has it); kind: what it is to the "
              "catalog model; the estimate's notes say what its own config.json sets otherwise")
    return 0


def _table(title: str, header: list[str], cells: list[list[str]], wide: bool, pad_edge: bool = True) -> Table:
    """A catalog table, its "Hub id" column only where the terminal is wide enough."""
    table = Table(title=title, title_justify="left", pad_edge=pad_edge)
    for column in header:
        if column != "Hub id" or wide:
            table.add_column("params" if column == "parameters" else column,
                             no_wrap=column in ("name", "family", "alias", "config"),
                             justify="right" if column in ("parameters", "layers", "context") else "left")
    for row in cells:
        table.add_row(*(c for c, name in zip(row, header, strict=True) if name != "Hub id" or wide))
    return table


def _count(n: int) -> str:
    """1_235_814_400 -> "1.24B", 999_885_952 -> "1B", 149_655_232 -> "150M"."""
    return f"{n / 1e9:.3g}B" if n >= 999.5e6 else f"{n / 1e6:.3g}M"


def run_env(args: argparse.Namespace) -> int:
    from anatomist.envinfo import read_environment

    env = read_environment()
    if args.json:
        print_json(env.to_dict())
        return 0
    out = console()
    out.print(f"python {env.python}, torch {env.torch} (CUDA {env.cuda or 'none: CPU build'}), transformers {env.transformers}")
    out.print(f"driver: {env.driver or 'none'}; GPU: {env.gpu or 'none'}; bf16: {env.bf16}; tf32: {env.tf32}")
    for name, version in env.packages.items():
        out.print(f"  {name:13} {version or '[dim]not installed[/]'}")
    for line in env.advice:
        out.print(f"- {line}")
    return 0
