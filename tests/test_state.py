import pytest

from tbo import State


def test_attribute_style_write_once():
    s = State(a=1)
    s.b = 2
    assert (s.a, s.b) == (1, 2)
    with pytest.raises(AttributeError, match="'b' is already set"):
        s.b = 3
    assert s.b == 2


def test_missing_key_names_present_keys():
    s = State(x=1)
    with pytest.raises(AttributeError, match=r"no key 'y'; it has \['x'\]"):
        _ = s.y
    with pytest.raises(KeyError, match="no key 'y'"):
        s.pop("y")


def test_pop_get_update_contains():
    s = State()
    s.update(a=1, b=2)
    assert "a" in s and len(s) == 2
    assert s.get("zz") is None and s.get("zz", 5) == 5
    assert s.pop("a") == 1 and "a" not in s
    assert s.pop("a", None) is None
    s.a = 10  # after a pop the key may be set again
    assert s.a == 10
    with pytest.raises(AttributeError, match=r"\['b'\] are already set"):
        s.update(b=3, c=4)
    assert "c" not in s  # nothing written when any key clashes


def test_reserved_names_rejected():
    s = State()
    with pytest.raises(AttributeError, match="shadow"):
        s.pop = 1  # type: ignore[method-assign]
    with pytest.raises(AttributeError, match="shadow"):
        State(clear=1)


def test_clear_guard():
    s = State(a=1, b=2, c=3)
    with pytest.raises(ValueError, match=r"unexpected keys remain \['b', 'c'\]"):
        s.clear(expect_keys=["a"])
    assert len(s) == 3  # nothing lost when it raises
    s.clear(expect_keys=["a", "b", "c", "d"])
    assert len(s) == 0
    s.x = 1
    with pytest.raises(ValueError):
        s.clear()


def test_delattr_pops():
    s = State(a=1)
    del s.a
    assert "a" not in s


def test_pinned_keys_survive_clear_and_refuse_pop():
    s = State()
    s.pin(microbatch_idx=1, num_microbatches=2)
    s.tmp = "tensor"
    s.clear(expect_keys=["tmp"])
    assert (s.microbatch_idx, s.num_microbatches) == (1, 2) and "tmp" not in s
    assert s.pinned == {"microbatch_idx", "num_microbatches"}
    with pytest.raises(KeyError, match="pinned"):
        s.pop("microbatch_idx")
    with pytest.raises(AttributeError, match="already set"):
        s.microbatch_idx = 5
    s.leak = 1
    with pytest.raises(ValueError, match=r"\['leak'\]"):
        s.clear()
