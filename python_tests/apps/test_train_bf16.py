"""``apps/train.py --precision bf16-mixed``: bfloat16 parameters under autocast, float32
masters, no loss scaling; the run trains and its model state keeps bfloat16."""
from __future__ import annotations

import numpy as np
import train  # noqa: E402 - apps/ is on sys.path (conftest)


def test_bf16_mixed_trains_without_a_loss_scale():
    result = train.train(train.parse_args(["--model", "mlp", "--max-steps", "20", "--seed", "1",
                                           "--precision", "bf16-mixed", "--no-progress"]))
    assert {str(np.asarray(v).dtype) for v in result["model_state"].values()} == {"bfloat16"}
    assert result["scaler"]["enabled"] is False and result["scaler"]["skipped_steps"] == 0
    losses = result["losses"]
    assert np.mean(losses[-5:]) < 0.75 * np.mean(losses[:5]), losses

