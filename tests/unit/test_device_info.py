"""verl_quads/nvfp4/device_info.py: the dispatch's device facts are read from torch once per device index (no GPU
here: torch.cuda's two readers are replaced by counting stand-ins)."""

import torch

from verl_quads.nvfp4 import device_info as di


def test_device_facts_are_read_once_per_index(monkeypatch):
    calls = []

    def cap(i):
        calls.append(("cap", i))
        return (9, i)

    def props(i):
        calls.append(("props", i))
        return type("P", (), {"multi_processor_count": 100 + i})()

    monkeypatch.setattr(torch.cuda, "get_device_capability", cap)
    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(di, "_CAPABILITY", {})
    monkeypatch.setattr(di, "_SMS", {})
    for _ in range(3):
        assert di.capability(torch.device("cuda", 0)) == (9, 0)
        assert di.capability(torch.device("cuda")) == (9, 1)  # no index: the current device
        assert di.capability(1) == (9, 1)
        assert di.sm_count(torch.device("cuda", 2)) == 102
        assert di.sm_count() == 101
    assert sorted(calls) == [("cap", 0), ("cap", 1), ("props", 1), ("props", 2)]
