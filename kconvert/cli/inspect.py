"""`kconvert inspect`: sizes from headers and config, before anything is downloaded."""

from __future__ import annotations

import json

import click

from kconvert.cli.base import FORMATS, KconvertCommand, gpu_memory_option
from kconvert.common.options import AS_FORMATS

P48_STORAGES = ("pair-bitmask", "dense")  # kconvert.sizing.predict.P48_STORAGES
KV_DTYPES = ("bf16", "fp16", "fp8")  # kconvert.sizing.deploy.KV_DTYPE_BYTES


@click.command("inspect", cls=KconvertCommand)
@click.argument("src")
@click.option("--as", "as_format", type=click.Choice(AS_FORMATS), default=None,
              help="Size the output of converting to these numbers (nvfp4, mxfp4: "
                   "int4-to-nvfp4 / int4-to-mxfp4 or quantize, its --format; bf16: dequant; "
                   "int4: an INT4 source as it is).")
@click.option("--keep", type=click.IntRange(min=1), default=None,
              help="Size the output of `reap --keep N` (routed experts kept per layer).")
@click.option("--p48", type=click.Choice(P48_STORAGES), default=None,
              help="Size the output of `sparsify --storage ...` (paired-4:8 NVFP4 experts).")
@click.option("--targets", default=None,
              help="With --as nvfp4|mxfp4 / --p48: what is quantized.")
@click.option("--format", type=click.Choice(FORMATS), default=None,
              help="With --as nvfp4|mxfp4 / --p48: the on-disk format.")
@click.option("--gpus", type=click.IntRange(min=1), default=None,
              help="GPUs to serve on [default: TP x PP].")
@click.option("--gpu-mem", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Memory per GPU in GiB (what nvidia-smi reports, e.g. 179 for a B200).")
@click.option("--mem-util", type=click.FloatRange(0, 1, min_open=True), default=0.9,
              show_default=True,
              help="Fraction of --gpu-mem the server may use (vLLM's gpu_memory_utilization).")
@click.option("--tp", type=click.IntRange(min=1), default=None,
              help="Tensor-parallel GPUs per pipeline stage [default: GPUs / PP].")
@click.option("--ep", type=click.IntRange(min=1), default=None,
              help="Expert-parallel ranks, a divisor of TP [default: 1].")
@click.option("--pp", type=click.IntRange(min=1), default=None,
              help="Pipeline stages [default: 1].")
@click.option("--context", type=click.IntRange(min=1), default=None,
              help="Tokens of context to check against the memory left.")
@click.option("--kv-dtype", type=click.Choice(KV_DTYPES), default="bf16", show_default=True,
              help="KV-cache element type.")
@gpu_memory_option("Plan each GPU command's memory for this budget, e.g. 40GiB [default: "
                   "this machine's GPU's default budget, else an 80 GB H100's].")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--revision", default=None, help="Hub revision when SRC is a repo id.")
@click.option("--token", envvar="HF_TOKEN", default=None,
              help="Hugging Face token for a gated or private repo [env: HF_TOKEN].")
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None,
              help="Hugging Face cache directory [default: huggingface_hub's].")
def inspect_cmd(src, as_format, keep, p48, targets, format, gpus, gpu_mem, mem_util, tp, ep,
                pp, context, kv_dtype, gpu_memory, as_json, revision, token, cache_dir):
    """Sizes of SRC by component, of the output an option would write, per GPU, and the KV
    cache, from safetensors headers and config.json alone (no tensor data is read; a Hub repo
    id downloads only config.json and the index)."""
    from kconvert.api import size_report

    report = size_report(src, as_format=as_format, keep=keep, p48=p48, targets=targets,
                         format=format, gpus=gpus, gpu_mem=gpu_mem, mem_util=mem_util, tp=tp,
                         ep=ep, pp=pp, context=context, kv_dtype=kv_dtype, revision=revision,
                         token=token, cache_dir=cache_dir, gpu_memory=gpu_memory)
    click.echo(json.dumps(report.to_json(), indent=1) if as_json else report.render())
