"""Routing profiles (`estream-pack --order-profile FILE`) go through one validator: whatever the
file holds, the result is an accepted profile whose orders are permutations, or one ProfileError
line naming the file and the problem; never a traceback, never a half-written pack."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from estream_layout import ModelSpec, ProfileError, load_routing_profile
from estream_layout.cli import pack_main
from estream_layout.pack import _resolve_orders

GOOD_COUNTS = [5, 90, 1, 40, 40, 0, 7, 3]


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('{"layers": {"0": {"counts": ["5", 1, 1, 1, 1, 1, 1, 1]}}}', r"counts\[0\] is str '5'"),
        ('{"layers": {"0": {"counts": "12345678"}}}', "counts must be a list of numbers"),
        ('{"layers": {"0": {"counts": [true, 1, 1, 1, 1, 1, 1, 1]}}}', r"counts\[0\] is bool"),
        ('{"layers": {"1.5": {"counts": [1, 1, 1, 1, 1, 1, 1, 1]}}}', "layer key '1.5' is not"),
        ('{"layers": {"x": {"counts": [1, 1, 1, 1, 1, 1, 1, 1]}}}', "layer key 'x' is not"),
        ('{"layers": {"\\u0663": {"counts": [1, 1, 1, 1, 1, 1, 1, 1]}}}', "is not a layer index"),
        ('{"layers": {" 1": {"counts": [1, 1, 1, 1, 1, 1, 1, 1]}}}', "layer key ' 1' is not"),
        ('{"layers": [{"index": 1.5, "counts": [1]}]}', r'layers\[0\] needs an "index"'),
        ('{"layers": [{"index": "1", "counts": [1]}]}', r'layers\[0\] needs an "index"'),
        ('{"layers": {"0": {"counts": [1, 1], "coactivation": [[1, 2]]}}}',
         "coactivation must be 2x2"),
        ('{"layers": {"0": {"counts": [1, 1], "coactivation": [[1, 2], [3]]}}}',
         r"coactivation\[1\] has 1 entries, expected 2"),
        ('{"layers": {"0": {"counts": [1, 1], "coactivation": [[1, 2], [3, "4"]]}}}',
         r"coactivation\[1\]\[1\] is str"),
        ('{"layers": {"0": {"counts": [NaN, 1, 1, 1, 1, 1, 1, 1]}}}', "NaN is not a JSON number"),
        ('{"layers": {"0": {"counts": [Infinity, 1]}}}', "Infinity is not a JSON number"),
        ('{"layers": {"0": {"counts": [1e309, 1, 1, 1, 1, 1, 1, 1]}}}', "1e309 is out of range"),
        ('{"layers": {"0": {"counts": [-1, 1, 1, 1, 1, 1, 1, 1]}}}', r"counts\[0\] = -1 is not"),
        ('{"layers": {"0": {"counts": [1%s, 1, 1, 1, 1, 1, 1, 1]}}}' % ("0" * 400),
         r"counts\[0\] = a huge integer is not a finite number"),
        ('{"layers": {"0": {"counts": [1, 1, 1, 1, 1, 1, 1, 1]}, "0": {"counts": [1]}}}',
         "key '0' appears twice"),
        ('{"layers": [{"index": 1, "counts": [1, 1, 1, 1, 1, 1, 1, 1]},'
         ' {"index": 1, "counts": [1, 1, 1, 1, 1, 1, 1, 1]}]}', "layer 1 appears twice"),
        ('{"layers": {"0": {"counts": []}}}', "counts has 0 entries"),
        ('{"layers": {"5": {"counts": [1, 1, 1, 1, 1, 1, 1, 1]}}}', "names layer 5, not a MoE"),
        ('{"layers": {"0": {"counts": [1, 1]}}}', "layer 0: 2 counts for 8 experts"),
        ('{"layers": 7}', '"layers" must be an object or a list'),
        ("[]", 'needs a "layers" field'),
        ("{not json", "not valid JSON"),
        ("[" * 50_000 + "]" * 50_000, "nested too deeply"),
    ],
)  # fmt: skip
def test_bad_profile_files_are_one_line_naming_the_file(
    tiny_models: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    text: str,
    needle: str,
) -> None:
    """Each malformed profile ends `estream-pack` with exit 2 and one line that names the file
    and the problem, and writes nothing."""
    import re

    prof = tmp_path / "p.json"
    prof.write_text(text)
    dst = tmp_path / "o.estream"
    rc = pack_main([str(tiny_models["olmoe"]), "-o", str(dst), "--order-profile", str(prof),
                    "--no-progress"])  # fmt: skip
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"estream-pack: error: routing profile {prof}: "), lines[0]
    assert re.search(needle, lines[0]), lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.json"]


@pytest.mark.parametrize("kind", ["missing", "directory", "not-utf8"])
def test_unreadable_profile_files_are_one_line(
    tiny_models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    """A profile path that is missing, a directory or not text: one line naming it."""
    prof = tmp_path / "p.json"
    if kind == "directory":
        prof.mkdir()
    elif kind == "not-utf8":
        prof.write_bytes(b'{"layers": "\xff"}')
    rc = pack_main([str(tiny_models["olmoe"]), "-o", str(tmp_path / "o.estream"),
                    "--order-profile", str(prof), "--no-progress"])  # fmt: skip
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and str(prof) in lines[0], lines
    assert not (tmp_path / "o.estream").exists()


def test_a_valid_profile_still_orders_hot_experts_first(tmp_path: Path) -> None:
    """The validator accepts what the profiler writes (integers and floats, both layer forms)."""
    prof = tmp_path / "p.json"
    co = (np.arange(64).reshape(8, 8) % 5).astype(float).tolist()
    prof.write_text(json.dumps({"layers": {"0": {"counts": GOOD_COUNTS, "coactivation": co},
                                           "1": {"counts": [0.5] * 8}}}))  # fmt: skip
    got = load_routing_profile(prof)
    assert sorted(got) == [0, 1]
    assert got[0]["counts"].tolist() == GOOD_COUNTS and got[0]["coactivation"].shape == (8, 8)
    assert got[1]["coactivation"] is None
    prof.write_text(json.dumps({"layers": [{"index": 1, "counts": GOOD_COUNTS}]}))
    assert load_routing_profile(prof)[1]["counts"].tolist() == GOOD_COUNTS


def test_explicit_orders_must_be_integer_ids(tiny_models: dict[str, Path]) -> None:
    """`order={layer: [ids]}` (the API form): floats, booleans and non-integer layer keys are
    refused instead of being truncated to a different order."""
    spec = ModelSpec.from_gguf(tiny_models["olmoe"])
    ids = list(range(8))
    for bad in ({0: [float(i) for i in ids]}, {"٣": ids}, {True: ids}, {0: [True, *ids[1:]]}):
        with pytest.raises(ProfileError):
            _resolve_orders(spec, bad)
    assert _resolve_orders(spec, {"1": ids[::-1]})[0][1] == ids[::-1]


_SCALAR = st.one_of(
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.text(max_size=4),
    st.sampled_from([0, 1, 7, 8, 9, 1e309, -1, 0.5]),
)
_JSON = st.recursive(
    _SCALAR,
    lambda inner: st.one_of(
        st.lists(inner, max_size=9), st.dictionaries(st.text(max_size=3), inner, max_size=4)
    ),
    max_leaves=40,
)
_KEY = st.one_of(st.sampled_from(["0", "1", "2", "01", "1.5", "-1", "x", "٣", ""]), st.text())
_COUNTS = st.one_of(st.lists(_SCALAR, min_size=0, max_size=9),
                    st.lists(st.integers(0, 100), min_size=8, max_size=8), _JSON)  # fmt: skip
_ENTRY = st.one_of(
    st.fixed_dictionaries(
        {"counts": _COUNTS},
        optional={
            "coactivation": st.one_of(
                st.lists(st.lists(_SCALAR, max_size=9), max_size=9),
                st.lists(
                    st.lists(st.integers(0, 9), min_size=8, max_size=8), min_size=8, max_size=8
                ),
                _JSON,
            )
        },
    ),
    _JSON,
)
_PROFILE = st.one_of(
    st.fixed_dictionaries(
        {
            "layers": st.one_of(
                st.dictionaries(_KEY, _ENTRY, max_size=3), st.lists(_ENTRY, max_size=3), _JSON
            )
        }
    ),
    _JSON,
)


@settings(max_examples=300, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=_PROFILE)
def test_any_json_profile_is_accepted_or_one_clear_error(
    tiny_models: dict[str, Path], tmp_path: Path, doc: Any
) -> None:
    """Arbitrary JSON (NaN and infinities included, as Python's json writes them): either a
    ProfileError naming the file, in one line, or a profile of finite non-negative counts
    whose orders are permutations of the experts."""
    spec = ModelSpec.from_gguf(tiny_models["olmoe"])
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps(doc))
    try:
        orders, _ = _resolve_orders(spec, prof)
    except ProfileError as e:
        msg = str(e)
        assert "\n" not in msg and str(prof) in msg, msg
        return
    for layer, order in orders.items():
        assert sorted(order) == list(range(spec.n_experts)), layer
    for entry in load_routing_profile(prof).values():
        assert all(math.isfinite(c) and c >= 0 for c in entry["counts"])
