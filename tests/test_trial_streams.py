"""Each trial's own random stream (mtbert/core/trial_streams.py): a trial's step draws its
dropout masks (alone), SMART's noise and PCGrad's task orders from its own generator, so
given the same batches it draws -- and so computes -- the same alone and in a group of 2 or
3 with other trials (float64; in a group the masks are one draw from the group's stream),
and a step neither reads nor sets torch's global generator."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny_model

from mtbert.core.trial_streams import StreamReplay, trial_draw
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


@pytest.fixture(scope="module")
def quiet_model_dir(tmp_path_factory) -> str:
    """The tiny BERT without attention-probability dropout: a trial at dropout 0 draws no
    mask (in a group the masks are the group stream's, not the trial's)."""
    folder = make_tiny_model(tmp_path_factory.mktemp("quiet-bert"))
    config = json.loads((folder / "config.json").read_text())
    config["attention_probs_dropout_prob"] = 0.0
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


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
def test_a_trial_draws_the_same_alone_and_in_a_group(tiny_config, quiet_model_dir, tmp_path,
                                                     others):
    """SMART (two ascent steps, the teacher) and PCGrad: given the same batches, the watched
    trial's losses of 4 summed steps are the same alone (the solo step) and stacked with 1
    or 2 other trials of other seeds, SMART values and dropout on (float64, within 1e-10),
    and its stream stands at the same state after them: its noise and task orders are its
    own, whoever it trains with (the others' masks, drawn from the group's stream, move it
    not)."""
    model = dict(model=quiet_model_dir)
    alone = _trial(tiny_config, tmp_path / "alone", **TRIAL, **model, dropout=0.0)
    solo = _steps(EagerStep(OneTrial(alone)), [alone], alone, 4)
    watched = _trial(tiny_config, tmp_path / "watched", **TRIAL, **model, dropout=0.0)
    group = [watched] + [_trial(tiny_config, tmp_path / f"other{i}", **values, **model)
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


def test_each_trials_slice_is_drawn_from_its_own_generator():
    """:func:`trial_draw` under ``vmap``: trial n's slice is what its generator alone draws
    in that shape, for any N."""
    def draw(out, generator, n):
        out.bernoulli_(0.7, generator=generator)

    x = torch.randn(3, 4, 5)
    together = torch.func.vmap(lambda a: trial_draw(a, draw, generators),
                               randomness="different")(
        x) if (generators := [torch.Generator().manual_seed(s) for s in (7, 8, 9)]) else None
    for n, seed in enumerate((7, 8, 9)):
        alone = trial_draw(x[n], draw, [torch.Generator().manual_seed(seed)])
        assert torch.equal(together[n], alone)


def test_stream_replay_draws_again_and_leaves_the_stream_where_it_stood():
    gens = [torch.Generator().manual_seed(s) for s in (1, 2)]
    replay = StreamReplay(gens)
    remembered = replay.remember()
    first = [torch.rand(4, generator=g) for g in gens]
    after = [g.get_state() for g in gens]
    with replay.replay(remembered):
        again = [torch.rand(4, generator=g) for g in gens]
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert all(torch.equal(g.get_state(), s) for g, s in zip(gens, after))


def test_a_replay_takes_a_trial_s_recorded_draws_again_without_drawing():
    """One trial's stream: the draws trial_draw took after remember() are given back, the
    same tensors, by each replay (the generator does not move inside it); outside a replay
    and after release() draws are fresh; a replay asking for another shape is an error."""
    gen = torch.Generator().manual_seed(5)
    replay = StreamReplay([gen])
    drawn = []

    def draw(out, generator, n):
        drawn.append(out.shape)
        out.bernoulli_(0.9, generator=generator)

    x, y = torch.zeros(6, 7), torch.zeros(3)
    remembered = replay.remember()
    first = [trial_draw(x, draw, [gen]), trial_draw(y, draw, [gen])]
    after = gen.get_state()
    for _ in range(2):
        with replay.replay(remembered):
            again = [trial_draw(x, draw, [gen]), trial_draw(y, draw, [gen])]
            assert torch.equal(gen.get_state(), remembered[0][0])  # nothing drawn
        assert again[0] is first[0] and again[1] is first[1]
        assert torch.equal(gen.get_state(), after)
    assert len(drawn) == 2
    fresh = trial_draw(x, draw, [gen])  # after the replays: a new draw from the stream
    assert len(drawn) == 3 and not torch.equal(gen.get_state(), after)
    with pytest.raises(RuntimeError, match="replayed forward's draw 0"):
        with replay.replay(remembered):
            trial_draw(y, draw, [gen])
    replay.release(remembered)
    with replay.replay(remembered):  # released: nothing kept, the stream's states replayed
        assert torch.equal(trial_draw(x, draw, [gen]), first[0])
    assert len(drawn) == 4 and fresh.shape == x.shape
