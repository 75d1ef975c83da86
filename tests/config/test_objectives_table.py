"""The objectives table (config/objectives.py): what each objective reads and holds, and the flags it refuses."""

from __future__ import annotations

import pytest

from finetune.config.flags import parse_config
from finetune.config.objectives import LOSS_FORMS, OBJECTIVES, log_prob_form, precomputes_reference
from finetune.config.options import TrainConfig
from finetune.config.switches import LOSSES
from finetune.errors import ConfigError


def test_every_objective_says_what_it_reads_and_holds():
    """Pairs run two sequences per example with gradients; a reference objective reads as many through
    the reference (KTO: its row and its mismatched row); the reference-free ones read none; only the
    supervised loss counts tokens, and only it lacks a beta."""
    for objective in OBJECTIVES.values():
        assert objective.rows in ("single", "paired", "labelled")
        assert objective.sequences == (2 if objective.rows == "paired" else 1)
        assert objective.reference == (objective.name in ("dpo", "kto"))
        assert (objective.loss_count == "token") == (objective.name == "sft") == (objective.default_beta is None)
    assert OBJECTIVES["kto"].reference_sequences == 2 and OBJECTIVES["kto"].policy_no_grad_sequences == 1
    assert OBJECTIVES["dpo"].rows_per_example() == 2 and OBJECTIVES["kto"].rows_per_example() == 2


def test_loss_forms_are_the_switches_losses_and_preference_log_probs_hold_no_logits_where_sft_would_not():
    assert tuple(LOSS_FORMS) == LOSSES
    assert [log_prob_form(loss) for loss in LOSSES] == ["finetune-chunked", "finetune-chunked", "transformers"]


def test_full_fine_tuning_precomputes_its_reference_unless_told_otherwise():
    assert precomputes_reference("dpo", None, "full") and not precomputes_reference("dpo", None, "lora")
    assert precomputes_reference("kto", True, "qlora") and not precomputes_reference("dpo", False, "full")
    assert not precomputes_reference("simpo", None, "full") and not precomputes_reference("sft", None, "full")


@pytest.mark.parametrize("flags, says", [
    (["--objective", "dpo", "--packing"], "--packing with --objective dpo: a preference loss compares whole answers"),
    (["--objective", "orpo", "--train-on-prompt"], "--train-on-prompt with --objective orpo"),
    (["--objective", "simpo", "--precompute-reference"], "--precompute-reference: --objective simpo uses no reference"),
    (["--objective", "kto", "--dpo-loss", "ipo"], "--dpo-loss ipo shapes DPO's loss; add --objective dpo"),
    (["--beta", "0.2"], "--beta weighs a preference objective; --objective sft has none"),
    (["--objective", "dpo", "--beta", "0"], "--beta must be > 0"),
])
def test_what_an_objective_cannot_run_with_is_refused_with_the_fix(flags, says):
    with pytest.raises(ConfigError, match="Invalid configuration") as error:
        parse_config(flags)
    assert says in str(error.value)


def test_the_objective_flags_parse_and_default_to_supervised():
    assert TrainConfig().objective == "sft"
    config = parse_config(["--objective", "dpo", "--dpo-loss", "hinge", "--beta", "0.3", "--no-precompute-reference"])
    assert (config.objective, config.dpo_loss, config.beta, config.precompute_reference) == ("dpo", "hinge", 0.3, False)
    with pytest.raises(ConfigError, match="--objective: invalid choice: 'ppo'"):
        parse_config(["--objective", "ppo"])
