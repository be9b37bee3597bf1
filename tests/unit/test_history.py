"""History: per-epoch records, keys that appear late, state round trip, CSV."""

from __future__ import annotations

import csv
import math

from towers.training import History


def test_records_epochs_and_pads_late_keys(tmp_path):
    h = History()
    h.on_epoch_end(0, {"loss": 1.0})
    h.on_epoch_end(1, {"loss": 0.5, "val_loss": 0.7})
    h.on_epoch_end(2, {"val_loss": 0.6})
    assert h.epoch == [0, 1, 2] and len(h) == 3
    assert h["loss"][:2] == [1.0, 0.5] and math.isnan(h["loss"][2])
    assert math.isnan(h.history["val_loss"][0]) and h.history["val_loss"][1:] == [0.7, 0.6]
    other = History()
    other.load_state_dict(h.state_dict())
    assert other.epoch == h.epoch and other.history.keys() == h.history.keys()
    rows = list(csv.reader(open(h.to_csv(tmp_path / "out" / "h.csv"))))
    assert rows[0] == ["epoch", "loss", "val_loss"] and rows[2] == ["1", "0.5", "0.7"]
