import pytest

from colossal_lite.trainer.time import Interval, Time, TimeUnit


@pytest.mark.parametrize(
    "text, value, unit",
    [
        ("2ep", 2, TimeUnit.EPOCH),
        ("500ba", 500, TimeUnit.BATCH),
        ("0.25dur", 0.25, TimeUnit.DURATION),
        ("  3 EP ", 3, TimeUnit.EPOCH),
        ("1e2ba", 100, TimeUnit.BATCH),
        ("1dur", 1.0, TimeUnit.DURATION),
        (".5dur", 0.5, TimeUnit.DURATION),
    ],
)
def test_parse_good_strings(text, value, unit):
    t = Time.from_input(text)
    assert t.unit is unit
    assert t.value == value
    assert type(t.value) is (float if unit is TimeUnit.DURATION else int)


def test_from_input_int_and_time():
    assert Time.from_input(3) == Time(3, TimeUnit.EPOCH)
    assert Time.from_input(40, default_unit=TimeUnit.BATCH) == Time(40, TimeUnit.BATCH)
    t = Time(5, TimeUnit.BATCH)
    assert Time.from_input(t) is t


def test_str():
    assert str(Time.from_input("2ep")) == "2ep"
    assert str(Time.from_input("500ba")) == "500ba"
    assert str(Time.from_input("0.25dur")) == "0.25dur"


@pytest.mark.parametrize("bad", ["2 epochs", "", "ep", "-1ep", "3 steps", "1.2.3ba"])
def test_bad_strings_message(bad):
    with pytest.raises(ValueError) as info:
        Time.from_input(bad)
    msg = str(info.value)
    assert msg == f"invalid time {bad!r}: use an int or a string like '2ep', '500ba' or '0.25dur'"


@pytest.mark.parametrize(
    "bad, fragment",
    [
        ("1.5ep", "ep values must be positive integers"),
        ("0ba", "ba values must be positive integers"),
        ("0dur", "dur values must be in (0, 1]"),
        ("1.5dur", "dur values must be in (0, 1]"),
        (0, "ep values must be positive integers"),
        (-2, "ep values must be positive integers"),
    ],
)
def test_bad_values_message(bad, fragment):
    with pytest.raises(ValueError) as info:
        Time.from_input(bad)
    assert str(info.value).startswith(f"invalid time {bad!r}: ")
    assert fragment in str(info.value)


@pytest.mark.parametrize("bad", [None, True, [2], "1e400ep"])
def test_bad_types(bad):
    with pytest.raises(ValueError, match="invalid time"):
        Time.from_input(bad)


def test_to_steps():
    assert Time.from_input("2ep").to_steps(steps_per_epoch=10, total_steps=100) == 20
    assert Time.from_input("7ba").to_steps(10, 100) == 7
    assert Time.from_input("0.25dur").to_steps(10, 100) == 25
    assert Time.from_input("1dur").to_steps(10, 37) == 37


def test_interval_epoch():
    iv = Interval("2ep").bind(steps_per_epoch=5, total_steps=50)
    assert [e for e in range(0, 9) if iv.is_epoch_boundary(e)] == [2, 4, 6, 8]
    assert not any(iv.is_step_boundary(s) for s in range(1, 51))
    assert iv.to_steps() == 10
    assert str(iv) == "2ep"


def test_interval_int_uses_default_unit():
    iv = Interval(3, default_unit=TimeUnit.BATCH)
    assert [s for s in range(0, 10) if iv.is_step_boundary(s)] == [3, 6, 9]


def test_interval_batch():
    iv = Interval("4ba").bind(steps_per_epoch=5, total_steps=20)
    assert [s for s in range(0, 21) if iv.is_step_boundary(s)] == [4, 8, 12, 16, 20]
    assert not any(iv.is_epoch_boundary(e) for e in range(1, 5))


def test_interval_duration():
    iv = Interval("0.25dur").bind(steps_per_epoch=10, total_steps=40)
    assert [s for s in range(0, 41) if iv.is_step_boundary(s)] == [10, 20, 30, 40]
    assert not any(iv.is_epoch_boundary(e) for e in range(1, 5))
    tiny = Interval("0.001dur").bind(steps_per_epoch=10, total_steps=40)
    assert all(tiny.is_step_boundary(s) for s in range(1, 5))  # period is at least one step


def test_interval_duration_needs_bind():
    with pytest.raises(RuntimeError, match="bind"):
        Interval("0.5dur").is_step_boundary(3)


def test_interval_bind_validation():
    with pytest.raises(ValueError, match="total_steps must be a positive int"):
        Interval("1ep").bind(steps_per_epoch=3, total_steps=0)
