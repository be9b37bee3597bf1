"""Device placement you can see: names, the device() scope, soft placement, the op placement log.

Run: python examples/placement.py   (works without a GPU: /gpu:1 then falls back to CPU with one warning)
"""

import warnings

import torch
from torch import nn

import towers


def main() -> None:
    print("devices:", [str(d) for d in towers.list_devices()])

    # Every spelling users bring names the same device.
    assert towers.Device("GPU:1") == towers.Device("cuda:1") == towers.Device("/job:worker/task:0/device:GPU:1")
    print("'/device:GPU:1' ->", towers.Device("/device:GPU:1"), "->", towers.Device("/device:GPU:1").torch)

    # Tensors and modules created in the scope land on its device. Soft placement (the default)
    # falls back to CPU, once, with a warning naming both devices, when /gpu:1 does not exist.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with towers.device("/gpu:1") as placed:
            w = torch.randn(3, 3)
            layer = nn.Linear(3, 2)
    print(f"asked for /gpu:1, placed on {placed}: w on {w.device}, layer on {layer.weight.device}")
    for warning in caught:
        print("warning:", warning.message)

    # Hard placement: a missing device is an error that lists what is available.
    towers.set_soft_device_placement(False)
    try:
        with towers.device("/gpu:7") as placed:
            print("hard placement: /gpu:7 exists here, placed on", placed)
    except ValueError as err:
        print("hard placement:", err)
    finally:
        towers.set_soft_device_placement(True)

    # The placement log: each executed op with its device, through a torch dispatch mode.
    records: list = []
    with towers.log_device_placement(records=records, to_logger=False):
        layer(w).sum().backward()
    for record in records:
        print("placement:", record)


if __name__ == "__main__":
    main()
