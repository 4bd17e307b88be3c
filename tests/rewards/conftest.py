"""The ``mode`` fixture of the sandbox battery: each hostile case runs once per isolation mode that works here, with
the battery's short limits."""
import pytest

from dare.rewards import set_code_limits
from dare.rewards.code_reward import code_limits
from tests.rewards.sandbox_battery import HOSTILE_LIMITS, MODES


@pytest.fixture(params=MODES)
def mode(request):
    previous = code_limits()
    set_code_limits(HOSTILE_LIMITS, request.param)
    yield request.param
    set_code_limits(*previous)
