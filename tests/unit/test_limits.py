"""attnlab.limits: the caps are documented positive numbers; numbers for messages."""

from __future__ import annotations

from attnlab import limits
from attnlab.limits import describe_int


def test_describe_int_shortens_what_no_one_reads():
    assert describe_int(12_345) == "12,345"
    assert describe_int(10**40) == "a number of 41 digits"


def test_every_cap_is_a_positive_number_documented_in_the_module():
    for name in limits.__all__:
        if name.startswith("MAX_"):
            value = getattr(limits, name)
            assert isinstance(value, int | float) and value > 0, name
            assert f":data:`{name}`" in limits.__doc__, f"{name} is not listed in the module docstring"
