"""Profiles: JSON round trips, and bad documents rejected with the JSON path of the problem."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from estream_sched import LayerProfile, Profile, ProfileError, SyntheticSpec, synthetic_profile
from estream_sched.testing import profiles

SPEC = SyntheticSpec(n_experts=64, n_layers=3, groups=(1, 2, 4, 8, 16), queue_depths=(1, 2, 4))


@pytest.fixture(scope="module")
def doc() -> dict[str, Any]:
    return synthetic_profile(SPEC, seed=7).to_dict()


@given(profiles())
def test_round_trip(p: Profile) -> None:
    d = p.to_dict()
    again = Profile.from_dict(json.loads(json.dumps(d)))
    assert again == p
    assert again.to_dict() == d


def test_save_and_load(tmp_path: Path) -> None:
    p = synthetic_profile(SPEC, seed=1)
    path = tmp_path / "profile.json"
    p.save(path)
    assert Profile.from_path(path) == p
    assert not list(tmp_path.glob("*.tmp-*"))
    doc = json.loads(path.read_text())
    assert doc["format"] == "estream-profile" and doc["version"] == 1
    assert set(doc["candidates"]) == {"1", "2", "4", "8", "16"}


def test_measured_with_round_trips_and_is_optional(doc: dict[str, Any]) -> None:
    """``measured_with`` comes back as written (strings, integers, lists of strings); a
    document without it (profiles written before it existed) reads as an empty mapping and
    writes no such key."""
    assert "measured_with" not in doc
    assert Profile.from_dict(doc).measured_with == {}
    d = copy.deepcopy(doc)
    ident = {"cpu": "AMD EPYC", "threads": 2, "expert_formats": ["q4_k-t32r4", "q6_k-t32r4"]}
    d["measured_with"] = ident
    p = Profile.from_dict(json.loads(json.dumps(d)))
    assert p.measured_with == ident
    assert p.to_dict()["measured_with"] == ident
    assert p != Profile.from_dict(doc)  # part of the value


def test_m_per_token_round_trips_and_is_optional(doc: dict[str, Any]) -> None:
    """``m_per_token`` comes back as written; a document without it (or with null) reads as
    None and writes no such key; a direct construction with a negative one is refused."""
    assert "m_per_token" not in doc
    assert Profile.from_dict(doc).m_per_token is None
    assert Profile.from_dict({**doc, "m_per_token": None}).m_per_token is None
    p = Profile.from_dict(json.loads(json.dumps({**doc, "m_per_token": 151_552})))
    assert p.m_per_token == 151_552 and p.to_dict()["m_per_token"] == 151_552
    assert "m_per_token" not in Profile.from_dict(doc).to_dict()
    with pytest.raises(ProfileError, match="m_per_token: expected bytes >= 0 or null, got -3"):
        attrs.evolve(p, m_per_token=-3)


def test_not_json(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(ProfileError, match="is not valid JSON"):
        Profile.from_path(path)


def _drop_last(d: dict[str, Any]) -> None:
    d["candidates"]["4"][1]["read_times"].pop()


def _set(path: list[Any], value: Any) -> Callable[[dict[str, Any]], None]:
    def f(d: dict[str, Any]) -> None:
        node = d
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value

    return f


def _delete(path: list[Any]) -> Callable[[dict[str, Any]], None]:
    def f(d: dict[str, Any]) -> None:
        node = d
        for k in path[:-1]:
            node = node[k]
        del node[path[-1]]

    return f


BAD: list[tuple[Callable[[dict[str, Any]], None], str]] = [
    (_drop_last, "candidates.4[1].read_times: expected 16 numbers, got 15"),
    (_set(["version"], 2), "version: unsupported profile version 2 (this estream-sched reads 1)"),
    (_set(["format"], "gguf"), "format: expected 'estream-profile', got 'gguf'"),
    (_delete(["n_experts"]), "n_experts: missing"),
    (_set(["n_experts"], "64"), "n_experts: expected an integer, got '64' (str)"),
    (_set(["n_layers"], True), "n_layers: expected an integer, got True (bool)"),
    (_set(["expert_bytes"], 0), "expert_bytes: expected an integer >= 1, got 0"),
    (_set(["model"], 3), "model: expected a string, got 3 (int)"),
    (_set(["q_measured"], 8), "q_measured: 8 is not one of the measured queue depths [1, 2, 4]"),
    (_delete(["m_other", "8"]), "m_other: missing entry for g=8 (candidates are [1, 2, 4, 8, 16])"),
    (_set(["m_other", "2"], -5), "m_other.2: expected an integer >= 0, got -5"),
    (_set(["m_other", "x"], 5), "m_other.x: m_other key must be a positive integer, got 'x'"),
    (_set(["bandwidth", "2", "4"], 0), "bandwidth.2.4: expected a number > 0, got 0"),
    (
        _delete(["bandwidth", "16", "4"]),
        "bandwidth.16: queue depths [1, 2] differ from bandwidth.1's [1, 2, 4]; "
        "measure the same q for every g",
    ),
    (
        _set(["bandwidth", "32"], {"1": 1e9}),
        "bandwidth.32: no candidate profile for g=32 (candidates [1, 2, 4, 8, 16])",
    ),
    (_set(["candidates", "2"], {}), "candidates.2: expected a list of layer profiles, got dict"),
    (
        lambda d: d["candidates"]["8"].pop(),
        "candidates.8: 2 calibration layers, but candidates.1 has 3; every g must profile the same layers",
    ),
    (
        _set(["candidates", "1", 0, "t_ne"], -1.0),
        "candidates.1[0].t_ne: expected a number >= 0, got -1.0",
    ),
    (
        _set(["candidates", "1", 2, "t_ne"], None),
        "candidates.1[2].t_ne: expected a number, got None (null)",
    ),
    (_delete(["candidates", "2", 1, "exec_times"]), "candidates.2[1].exec_times: missing"),
    (
        _set(["candidates", "2", 1, "routes", 5], -1),
        "candidates.2[1].routes[5]: expected an integer >= 0, got -1",
    ),
    (
        _set(["candidates", "2", 1, "routes", 5], 1.5),
        "candidates.2[1].routes[5]: expected an integer, got 1.5 (float)",
    ),
    (
        _set(["candidates", "16", 0, "exec_times", 3], float("inf")),
        "candidates.16[0].exec_times[3]: expected a finite number, got inf",
    ),
    (
        _set(["candidates", "4", 0, "group_bytes", 2], 12345),
        "candidates.4[0].group_bytes[2]: expected 14155776 (4 experts x expert_bytes 3538944), got 12345",
    ),
    (_set(["candidates", "4", 0, "layer"], 3), "candidates.4[0].layer: must be in 0..2"),
    (_set(["candidates", "128"], []), "candidates.128: group size must be in 1..n_experts=64"),
    (_set(["meta"], []), "meta: expected an object, got list"),
    (_set(["measured_with"], "avx2"), "measured_with: expected an object, got str"),
    (
        _set(["measured_with"], {"threads": True}),
        "measured_with.threads: expected a string, an integer or a list of strings, got True (bool)",
    ),
    (
        _set(["measured_with"], {"formats": ["q4_0-t32r4", 3]}),
        "measured_with.formats: expected a string, an integer or a list of strings, "
        "got ['q4_0-t32r4', 3] (list)",
    ),
    (_set(["measured_with"], {"": "x"}), "measured_with: keys must be non-empty strings, got ''"),
    (_set(["m_per_token"], -1), "m_per_token: expected an integer >= 0, got -1"),
    (_set(["m_per_token"], 2.5), "m_per_token: expected an integer, got 2.5 (float)"),
    (_set(["m_per_token"], True), "m_per_token: expected an integer, got True (bool)"),
]


@pytest.mark.parametrize(("mutate", "message"), BAD, ids=[m for _, m in BAD])
def test_bad_profiles_are_rejected_precisely(
    doc: dict[str, Any], mutate: Callable[[dict[str, Any]], None], message: str
) -> None:
    d = copy.deepcopy(doc)
    mutate(d)
    with pytest.raises(ProfileError) as exc:
        Profile.from_dict(d)
    assert str(exc.value) == message
    assert exc.value.path == message.split(":")[0]


def test_empty_candidates(doc: dict[str, Any]) -> None:
    d = copy.deepcopy(doc)
    d["candidates"] = {}
    d["m_other"] = {}
    d["bandwidth"] = {}
    with pytest.raises(ProfileError, match=r"^candidates: no candidate group sizes$"):
        Profile.from_dict(d)


@given(st.data())
def test_any_corrupted_number_is_reported_at_its_path(data: st.DataObject) -> None:
    d = synthetic_profile(SPEC, seed=3).to_dict()
    g = data.draw(st.sampled_from(sorted(d["candidates"])))
    i = data.draw(st.integers(0, len(d["candidates"][g]) - 1))
    field = data.draw(st.sampled_from(["routes", "read_times", "exec_times", "group_bytes"]))
    k = data.draw(st.integers(0, len(d["candidates"][g][i][field]) - 1))
    bad = data.draw(st.sampled_from([-1, "7", None, [1], float("nan")]))
    d["candidates"][g][i][field][k] = bad
    with pytest.raises(ProfileError) as exc:
        Profile.from_dict(d)
    assert exc.value.path == f"candidates.{g}[{i}].{field}[{k}]"


def test_direct_construction_is_validated() -> None:
    p = synthetic_profile(SPEC, seed=2)
    lp = p.candidates[2][0]
    short = LayerProfile(
        t_ne=lp.t_ne,
        group_bytes=lp.group_bytes,
        routes=lp.routes[:-1],
        read_times=lp.read_times,
        exec_times=lp.exec_times,
    )
    cands = {g: list(v) for g, v in p.candidates.items()}
    cands[2][0] = short
    with pytest.raises(
        ProfileError, match=r"^candidates\.2\[0\]\.routes: expected 32 integers, got 31$"
    ):
        Profile(
            model=p.model,
            device=p.device,
            n_experts=p.n_experts,
            n_layers=p.n_layers,
            expert_bytes=p.expert_bytes,
            q_measured=p.q_measured,
            m_other=p.m_other,
            bandwidth=p.bandwidth,
            candidates=cands,
        )


def test_layer_profile_arrays_are_read_only() -> None:
    lp = synthetic_profile(SPEC, seed=2).candidates[1][0]
    with pytest.raises(ValueError):
        lp.read_times[0] = 1.0
    assert lp.routes.dtype == np.int64


def test_readme_example_is_a_valid_profile() -> None:
    readme = Path(__file__).resolve().parents[1] / "README.md"
    text = readme.read_text(encoding="utf-8")
    block = (
        text.split("## Profile JSON (version 1)", 1)[1].split("```json", 1)[1].split("```", 1)[0]
    )
    p = Profile.from_dict(json.loads(block))
    assert p.groups == [1, 4] and p.n_calibration_layers == 1
    assert p.candidates[4][0].group_bytes.tolist() == [4 * 3538944, 3538944]


def test_save_leaves_no_temporary_on_an_interrupt_or_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An interrupt the moment the temporary file is made, and an error while it is written,
    leave neither it nor a changed profile behind."""
    import os

    p = synthetic_profile(SPEC, seed=1)
    path = tmp_path / "profile.json"
    p.save(path)
    before = path.read_bytes()
    real_open = os.open

    def interrupted(name, *args, **kwargs):
        fd = real_open(name, *args, **kwargs)
        if ".tmp-" in os.fspath(name):
            os.close(fd)
            raise KeyboardInterrupt
        return fd

    with monkeypatch.context() as m:
        m.setattr(os, "open", interrupted)
        with pytest.raises(KeyboardInterrupt):
            synthetic_profile(SPEC, seed=2).save(path)
    assert sorted(x.name for x in tmp_path.iterdir()) == ["profile.json"]

    def failing(self: Profile) -> dict[str, Any]:
        return {"x": float("nan"), "y": object()}  # json.dump fails part-way

    monkeypatch.setattr(Profile, "to_dict", failing)
    with pytest.raises(TypeError):
        p.save(path)
    assert sorted(x.name for x in tmp_path.iterdir()) == ["profile.json"]
    assert path.read_bytes() == before
