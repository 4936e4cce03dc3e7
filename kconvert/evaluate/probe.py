"""The degeneration probe's two entries: `kconvert eval --generate` (the source's and one
candidate's continuations of held-out prompts, made by kconvert.evaluate.decode) and
`kconvert eval --generations` (texts any engine made, kconvert.evaluate.completions), both
judged by kconvert.evaluate.generation."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kconvert.calibrate.data import PAD_ID, TOKENIZER_FILES, load_calibration_data, shortfall
from kconvert.calibrate.forward import model_config
from kconvert.calibrate.startup import model_code_and_device
from kconvert.errors import KconvertError
from kconvert.evaluate import completions
from kconvert.evaluate.decode import Sampling, check_fits, continuations
from kconvert.evaluate.generation import Continuation, GenerationReport, compare
from kconvert.evaluate.loops import LoopRule
from kconvert.gpu.budget import GpuRequest
from kconvert.io.checkpoint import Checkpoint

# The files `--generate -o DIR` writes beside eval.json: each model's continuations in the
# --generations form, so a later run (or another engine's texts) can be compared with them.
SOURCE_FILE = "generations-source.jsonl"
CANDIDATE_FILE = "generations-candidate.jsonl"


@dataclass(frozen=True)
class Probe:
    """What `--generate` runs: `prompts` held-out prompts of `prompt_tokens` tokens each,
    continued as `sampling` says, `batch_size` prompts a step, judged by `rule`."""

    prompts: int
    sampling: Sampling
    prompt_tokens: int = 64
    batch_size: int = 16
    rule: LoopRule = field(default_factory=LoopRule)


@dataclass
class ProbeResult:
    report: GenerationReport
    source: list[Continuation]
    candidate: list[Continuation]

    def write(self, out: Path) -> None:
        completions.write_generations(out / SOURCE_FILE, self.source)
        completions.write_generations(out / CANDIDATE_FILE, self.candidate)


def prompts_from(data: str, tokenizer_dir: str | Path, probe: Probe, seed: int, vocab: int,
                 allow_short: bool, echo: Callable[[str], None]) -> torch.Tensor:
    """The probe's prompts [n, prompt_tokens]: eval's data read as eval reads it (the same
    lines in the same seeded order), cut into pieces of prompt_tokens; a last piece cut short
    is left out."""
    ids = load_calibration_data(data, tokenizer_dir, probe.prompts, probe.prompt_tokens, seed,
                                vocab=vocab, short=shortfall(allow_short, echo))
    full = ids[(ids != PAD_ID).all(1)]
    if not len(full):
        raise KconvertError(f"the eval data holds no prompt of --prompt-tokens "
                            f"{probe.prompt_tokens} tokens", file=str(data))
    return full


def decoding_tokenizer(tokenizer_dir: str | None, source: Checkpoint):
    """The tokenizer that turns continuations into text: --tokenizer, else the source's own
    when its directory has one, else None (a byte vocabulary, kconvert.evaluate.decode)."""
    where = Path(tokenizer_dir) if tokenizer_dir is not None else Path(source.root)
    if any((where / f).is_file() for f in TOKENIZER_FILES):
        return completions.load_tokenizer(str(where))
    return None


def check_probe_fits(models: list[tuple[str, Checkpoint]], probe: Probe, gpu: GpuRequest,
                     dtype: torch.dtype) -> None:
    """Refuse, before eval's teacher-forced pass, a model the probe cannot hold
    (decode.check_fits); on a GPU once the device has started (the budget reads it)."""
    budget = None
    if gpu.device.type == "cuda":
        model_code_and_device(gpu.device)
        budget = gpu.context.budget
    for label, ckpt in models:
        check_fits(label, ckpt, min(probe.batch_size, probe.prompts),
                   probe.prompt_tokens + probe.sampling.new_tokens, dtype, gpu.device, budget)


def run_probe(source: Checkpoint, candidate: Checkpoint, labels: tuple[str, str], data: str,
              tokenizer_dir: str | None, probe: Probe, gpu: GpuRequest, dtype: torch.dtype,
              seed: int, allow_short: bool, echo: Callable[[str], None]) -> ProbeResult:
    """`--generate`: both models' continuations of the same prompts, one model in memory at a
    time (`check_probe_fits` first)."""
    cfgs = [model_config(c) for c in (source, candidate)]
    prompts = prompts_from(data, tokenizer_dir or source.root, probe, seed,
                           source.text_config["vocab_size"], allow_short, echo)
    device = gpu.device
    tokenizer = decoding_tokenizer(tokenizer_dir, source)
    made = []
    guard = (gpu.context.enforced("eval --generate", "--generate-batch-size")
             if device.type == "cuda" else contextlib.nullcontext())
    with guard:
        for label, ckpt, cfg in zip(labels, (source, candidate), cfgs, strict=True):
            try:
                made.append(continuations(ckpt, cfg, prompts, probe.sampling, device, dtype,
                                          probe.batch_size, tokenizer))
            except KconvertError as exc:
                raise KconvertError(f"{label}: {exc}") from exc
            gc.collect()  # the model's layers, before the next model is decoded
            if device.type == "cuda":
                torch.cuda.empty_cache()
    s = probe.sampling
    report = compare(made[0], made[1], probe.rule, new_tokens=s.new_tokens,
                     temperature=s.temperature,
                     sample_seed=s.seed if s.temperature > 0 else None)
    return ProbeResult(report, made[0], made[1])


def compare_files(source: str, candidate: str, tokenizer_dir: str | None, rule: LoopRule
                  ) -> GenerationReport:
    """`--generations`: two engines' (or one engine's two models') JSONL texts compared; every
    line of both files is checked before anything is measured."""
    src, cand = completions.read_generations(source, candidate, tokenizer_dir)
    return compare(src, cand, rule)
