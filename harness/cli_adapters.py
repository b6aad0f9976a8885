"""``lpdiff models`` (the catalog) and ``lpdiff adapters gen|convert`` (seeded adapters, layout conversion)."""

from __future__ import annotations

import click

from lpdiff.harness.cli_common import EXIT_OK, LAYOUTS


@click.command()
def models() -> int:
    """The model catalog with shapes."""
    from lpdiff.harness.pipeline.report import table
    from lpdiff.harness.spec.catalog import describe, list_models

    rows = [describe(m) for m in list_models()]
    cols = list(rows[0]) if rows else []
    click.echo(table([[r.get(c, "") for c in cols] for r in rows], cols))
    return EXIT_OK


@click.group()
def adapters() -> None:
    """Generate or convert LoRA adapters."""


@adapters.command("gen")
@click.option("--model", required=True, help="catalog model, checkpoint directory or Hub id ORG/NAME[@REV]")
@click.option("--out", required=True)
@click.option("--groups", default="attention,experts", show_default=True)
@click.option("--rank", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--alpha", type=float, default=16, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--layout", type=LAYOUTS, default="peft3d", show_default=True)
@click.option("--rslora", is_flag=True, help="rsLoRA: scaling alpha/sqrt(r) (PEFT's use_rslora)")
@click.option(
    "--rank-pattern",
    default="",
    metavar="KEY=R,...",
    help="per-module ranks as PEFT's rank_pattern (KEY: a regex for a dotted suffix of the module path, "
    "e.g. q_proj=4,lm_head=16; the parameter path for 3D experts)",
)
@click.option("--alpha-pattern", default="", metavar="KEY=A,...", help="per-module alphas (PEFT's alpha_pattern)")
def adapters_gen(model, out, groups, rank, alpha, seed, layout, rslora, rank_pattern, alpha_pattern) -> int:
    """Write a seeded random adapter for a catalog model (groups: attention, experts, ..., lm_head, embed_tokens)."""
    import torch

    from lpdiff.harness.spec import adapters as ad
    from lpdiff.harness.spec.catalog import load_hf_model
    from lpdiff.harness.spec.resolve import resolve

    hf = load_hf_model(resolve(model, adapters=()).spec, torch.float32, "cpu")
    ad.generate_adapter(
        hf,
        out,
        groups=groups.split(","),
        rank=rank,
        alpha=alpha,
        seed=seed,
        layout=layout,
        use_rslora=rslora,
        rank_pattern=_pattern_option("--rank-pattern", rank_pattern, int),
        alpha_pattern=_pattern_option("--alpha-pattern", alpha_pattern, float),
    )
    click.echo(f"wrote {out}")
    return EXIT_OK


def _pattern_option(flag: str, text: str, cast) -> dict:
    out = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        try:
            out[key.strip()] = cast(value)
        except ValueError:
            sep = ""
        if not sep or not key.strip():
            raise click.BadParameter(
                f"{item!r}: give KEY={'R' if cast is int else 'ALPHA'} pairs separated by "
                "commas, e.g. q_proj=4,lm_head=16",
                param_hint=flag,
            )
    return out


@adapters.command("convert")
@click.option("--model", required=True, help="catalog model, checkpoint directory or Hub id ORG/NAME[@REV]")
@click.argument("src")
@click.argument("dst")
@click.option("--to", type=LAYOUTS, required=True)
@click.option(
    "--disk-root",
    default=None,
    metavar="ROOT",
    help="write the decoder's modules under ROOT instead of 'model' (e.g. model.language_model: the "
    "names vLLM reads on a Qwen3.5 checkpoint; backbone: Nemotron-H's on-disk name)",
)
def adapters_convert(model, src, dst, to, disk_root) -> int:
    """Rewrite an adapter in another expert layout (checked against PEFT's merge in the tests)."""
    from lpdiff.harness.spec import adapters as ad
    from lpdiff.harness.spec.catalog import hf_config
    from lpdiff.harness.spec.resolve import resolve

    ad.convert_adapter(
        src, dst, to=to, model_config=hf_config(resolve(model, adapters=(), weights=False).spec), disk_root=disk_root
    )
    click.echo(f"wrote {dst}")
    return EXIT_OK
