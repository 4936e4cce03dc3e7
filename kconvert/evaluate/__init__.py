"""`kconvert eval`: how far a converted, pruned or sparsified checkpoint is from its source.

The same tokens run through the source and every candidate with the calibration forward
(`kconvert.calibrate.forward`), one decoder layer of one checkpoint in memory at a time. Each
model keeps its own stream of hidden states. Per decoder layer L and candidate:
  rel_err        ||h_c(L) - h_s(L)|| / ||h_s(L)||, h(L) the hidden states after layer L of
                 each model's own stream (the accumulated error: what a user of the candidate
                 gets at that depth)
  rel_err_local  the same with the candidate's layer L run on the source's input to layer L
                 (what layer L alone adds)
norms taken over every real (non-padding) position. After the last layer, each model's final
norm and lm_head give next-token distributions, a chunk of positions at a time (logits are
never kept): KL(source || candidate) in nats (mean and p99 over real positions), top-1
agreement, top-5 overlap, and each model's mean next-token NLL (over positions whose next
token is real) and perplexity. A pruned candidate routes with its own router over its own
experts. `report.py` holds eval.json's model, the printed table and the figure. The KL is
also taken over the 10% of positions where the source's next-token entropy is highest.

The degeneration probe (docs/eval-generation.md): `--generate` continues held-out prompts with
the source and one candidate, the whole model in memory (`decode.py`), `--generations` reads two
engines' texts (`completions.py`), `probe.py` runs either, `loops.py` finds and classes looping
tails and `generation.py` holds the statistics (loop rates and their z test), with no torch.
"""
