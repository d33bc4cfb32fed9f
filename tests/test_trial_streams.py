"""Each trial's own random stream (mtbert/core/trial_streams.py): a trial's step draws its
masks' seed, SMART's noise and PCGrad's task orders from its own generator, and its dropout
masks are a hash of that seed, so given the same batches it draws -- and so computes -- the
same alone and in a group of 2 or 3 with other trials (float64); a step neither reads nor
sets torch's global generator; the masks themselves (MaskStream): each trial's alone,
vmapped and folded alike, unmoved by padding, kept at 1 − p, replayed."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny_model

from mtbert.core.trial_streams import MaskStream, folded_trials, keep_mask, keep_threshold
from mtbert.data import load_data
from mtbert.model.model import MultitaskModel
from mtbert.run.trial_run import TrialRun
from mtbert.step.stacked_trials import StackedTrials
from mtbert.step.step_engine import EagerStep, OneTrial

pytestmark = pytest.mark.usefixtures("one_torch_thread", "no_kept_step")

#: dropout on (hidden, heads and attention probabilities), SMART with both terms, PCGrad
#: over the three tasks of a summed step
COMMON = dict(dropout=0.2, update="summed", schedule="round_robin", pcgrad=True,
              smart_steps=2, eval_every=10**6, eval_at_start=False, eval_dev=False)
#: the trial watched, and the others it is grouped with: their own seeds, rates and SMART
TRIAL = dict(seed=3, lr=1e-3, smart_lambda_sst=1.0, smart_lambda_qqp=0.5,
             smart_lambda_sts=2.0, smart_eps=1e-3, smart_mu=0.5, smart_noise=1e-4)
OTHERS = [dict(seed=4, lr=2e-3, dropout=0.3, smart_lambda_sst=3.0, smart_lambda_qqp=0.2,
               smart_lambda_sts=0.5, smart_eps=3e-3, smart_mu=2.0, smart_beta=0.9,
               smart_noise=4e-6, smart_step_size=2e-3),
          dict(seed=5, lr=5e-4, dropout=0.1, smart_lambda_sst=0.3, smart_lambda_qqp=4.0,
               smart_lambda_sts=1.0, smart_eps=2e-4, smart_mu=0.1, smart_noise=1e-4)]


def _trial(tiny_config, folder, **values) -> TrialRun:
    cfg = tiny_config(**{**COMMON, **values})
    torch.manual_seed(cfg.seed)
    model = MultitaskModel.from_config(cfg).to(torch.float64)
    return TrialRun(cfg, load_data(cfg), folder, model=model)


def _steps(engine, trials, watched, steps: int) -> list[dict[str, float]]:
    """``steps`` steps of ``trials``, every trial on the watched trial's batches; the
    watched trial's task losses of each."""
    seen = []
    for _ in range(steps):
        batches = watched.next_update()
        for other in trials:
            if other is not watched:
                other.next_update()  # its own batcher moves on; its batches are the watched's
        losses = engine.step({t: batches for t in trials})[watched]
        for t in trials:
            t.stepped(losses if t is watched else {})
        seen.append({task: float(loss) for task, loss in losses.items()})
    return seen


@pytest.mark.parametrize("others", [1, 2])
def test_a_trial_draws_the_same_alone_and_in_a_group(tiny_config, tmp_path, others):
    """Dropout (hidden, heads and attention probabilities), SMART (two ascent steps, the
    teacher) and PCGrad: given the same batches, the watched trial's losses of 4 summed
    steps are the same alone (the solo step) and stacked with 1 or 2 other trials of other
    seeds, rates and SMART values (float64, within 1e-10), and its stream stands at the same
    state after them: its masks, noise and task orders are its own, whoever it trains
    with."""
    alone = _trial(tiny_config, tmp_path / "alone", **TRIAL)
    solo = _steps(EagerStep(OneTrial(alone)), [alone], alone, 4)
    watched = _trial(tiny_config, tmp_path / "watched", **TRIAL)
    group = [watched] + [_trial(tiny_config, tmp_path / f"other{i}", **values)
                         for i, values in enumerate(OTHERS[:others])]
    stacked = _steps(EagerStep(StackedTrials(group)), group, watched, 4)
    assert [sorted(s) for s in solo] == [sorted(s) for s in stacked]
    worst = max(abs(a[t] - b[t]) for a, b in zip(solo, stacked) for t in a)
    print(f"\n[streams] alone vs a group of {others + 1}: {worst:.2g}")
    assert worst <= 1e-10
    assert torch.equal(alone.generator.get_state(), watched.generator.get_state())
    # the draws did act: another seed's stream gives other losses on the same batches
    assert alone.generator.get_state().ne(group[1].generator.get_state()).any()


@pytest.mark.parametrize("stacked", [False, True])
def test_a_step_neither_reads_nor_sets_the_global_generator(tiny_config, tmp_path, stacked):
    """Dropout on (hidden, heads, attention probabilities), SMART and PCGrad: the global
    generator's state is the same before and after a step (nothing drawn from it, nothing
    set), and a step's losses do not depend on it (seeded apart)."""
    losses, states = [], []
    for seed in (0, 1):
        trials = [_trial(tiny_config, tmp_path / f"{seed}-{i}", **values)
                  for i, values in enumerate([TRIAL] + (OTHERS[:1] if stacked else []))]
        engine = EagerStep(StackedTrials(trials) if stacked else OneTrial(trials[0]))
        torch.manual_seed(100 + seed)  # the global generator, elsewhere
        before = torch.get_rng_state()
        losses.append(_steps(engine, trials, trials[0], 2))
        assert torch.equal(torch.get_rng_state(), before)
        states.append(trials[0].generator.get_state())
    assert losses[0] == losses[1]
    assert torch.equal(states[0], states[1])


def _stream(seeds, task="qqp") -> MaskStream:
    """A mask stream of len(seeds) trials, each seed drawn from a generator seeded so, at
    ``task``'s forward."""
    stream = MaskStream(len(seeds), torch.device("cpu"))
    stream.draw({n: torch.Generator().manual_seed(s) for n, s in enumerate(seeds)})
    stream.start(task)
    return stream


def test_each_trials_mask_is_its_own_alone_vmapped_and_folded():
    """Trial n's slice of a mask over N trials -- under ``vmap`` or with their rows folded
    into one axis -- is its mask alone (its seed, the same draw's place), for any N; other
    seeds give other masks."""
    x, threshold = torch.randn(4, 2, 5, 5), keep_threshold(0.3)
    seeds = (1, 2, 3)
    alone = [keep_mask(x, threshold, _stream([s])) for s in seeds]
    stream = _stream(seeds)
    together = torch.func.vmap(lambda t: keep_mask(t, threshold, stream),
                               randomness="different")(torch.stack([x] * 3))
    with folded_trials(3):
        folded = keep_mask(torch.cat([x] * 3), threshold, _stream(seeds)).view(3, *x.shape)
    for n in range(3):
        assert torch.equal(together[n], alone[n]) and torch.equal(folded[n], alone[n])
    assert not torch.equal(alone[0], alone[1])


def test_a_mask_does_not_move_with_padding_and_keeps_one_minus_p():
    """An element's mask takes its coordinates: a tensor padded with more rows and longer
    axes (a group's shapes) keeps its elements' masks; over 3.1 M elements the kept share
    is 1 − p within 5 standard errors, neighbours and the next draw uncorrelated (|r| <
    0.005); per-trial rates ([N] thresholds) act per trial."""
    small, big = torch.empty(4, 2, 5, 5), torch.empty(6, 2, 7, 9)
    threshold = keep_threshold(0.3)
    assert torch.equal(keep_mask(big, threshold, _stream([4]))[:4, :, :5, :5],
                       keep_mask(small, threshold, _stream([4])))
    stream, p = _stream([9]), 0.1
    mask = keep_mask(torch.empty(64, 12, 64, 64), keep_threshold(p), stream).float()
    se = (p * (1 - p) / mask.numel()) ** 0.5
    assert abs(float(mask.mean()) - (1 - p)) <= 5 * se
    after = keep_mask(torch.empty(64, 12, 64, 64), keep_threshold(p), stream).float()
    pairs = [(mask[..., :-1], mask[..., 1:]), (mask[:-1], mask[1:]), (mask, after)]
    for a, b in pairs:
        assert abs(float(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1])) < 5e-3
    rates = torch.tensor([keep_threshold(0.0), keep_threshold(0.5)], dtype=torch.int32)
    two = _stream([1, 2])
    both = torch.func.vmap(lambda t: keep_mask(t, rates, two),
                           randomness="different")(torch.empty(2, 100, 100))
    assert bool(both[0].all()) and abs(float(both[1].float().mean()) - 0.5) < 0.02


def test_a_replay_gives_the_remembered_masks_again_and_the_place_back():
    """The masks drawn after remember() are given back, the same tensors, by each replay
    (nothing hashed again); after it the stream draws on where it stood; a new step (draw)
    or a new remember drops what was kept, and a replay then hashes the same masks again;
    another task's forward draws other masks."""
    stream = _stream([5], task="sst")
    x, y = torch.zeros(6, 7), torch.zeros(3)
    threshold = keep_threshold(0.4)
    remembered = stream.remember()
    first = [keep_mask(x, threshold, stream), keep_mask(y, threshold, stream)]
    for _ in range(2):
        with stream.replay(remembered):
            again = [keep_mask(x, threshold, stream), keep_mask(y, threshold, stream)]
        assert again[0] is first[0] and again[1] is first[1]
    fresh = keep_mask(x, threshold, stream)  # after the replays: the place moved on
    assert not torch.equal(fresh, first[0])
    stream.remember()  # another forward remembered: the first one's masks are dropped
    with stream.replay(remembered):
        hashed = keep_mask(x, threshold, stream)
    assert hashed is not first[0] and torch.equal(hashed, first[0])
    stream.start("sts")
    assert not torch.equal(keep_mask(x, threshold, stream), first[0])
