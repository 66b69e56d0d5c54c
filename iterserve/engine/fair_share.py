"""Fair share between tenants within a priority tier: the Virtual Token Counter.

Each tenant has a counter of the service it has received, in weighted tokens: every prompt
token the engine computes for it adds ``PREFILL_TOKEN_WEIGHT``, every output token it is sent
adds ``OUTPUT_TOKEN_WEIGHT``. Among waiting requests of equal effective priority the
tenant with the smallest counter goes first (then arrival), so a tenant sending ten times the
others' rate gets its share of the engine and not more while the others are backlogged; an
idle engine serves anyone. When a tenant with nothing waiting sends a request, its counter
is *lifted* to the smallest counter among the tenants that are waiting (or, when nobody
waits, to the counter of the tenant whose queue emptied last): a tenant that was away (or
just light) cannot bank credit and then starve the others.

Source: Y. Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024
(Algorithm 2, the Virtual Token Counter; weights w_p = 1, w_q = 2 as in its evaluation).

Our choices where the paper is silent: tokens the prefix cache supplies and tokens
recomputed after a preemption are not charged (the tenant did not get that service twice);
counters of tenants with no request in the engine are kept for the ``MAX_IDLE_TENANTS`` most
recently active ones (a forgotten tenant restarts at the lift, which is where the paper puts
a returning tenant anyway unless it had used more than the others).
"""

from __future__ import annotations

from collections import Counter, OrderedDict

PREFILL_TOKEN_WEIGHT = 1.0
OUTPUT_TOKEN_WEIGHT = 2.0
MAX_IDLE_TENANTS = 4096


class VirtualTokenCounter:
    """Per-tenant service counters (weighted tokens, float) and their lift.

    The scheduler tells it when a tenant's request joins or leaves the waiting queue and when
    one enters or leaves the engine, and charges the tokens it computes and samples.
    """

    def __init__(self) -> None:
        self.counters: dict[str, float] = {}
        self._num_waiting: Counter[str] = Counter()
        self._num_live: Counter[str] = Counter()
        # Counters of tenants with no request in the engine, least recently active first.
        self._idle: OrderedDict[str, float] = OrderedDict()
        self._last_emptied = 0.0  # counter of the tenant whose waiting queue emptied last

    def counter(self, tenant: str) -> float:
        """The tenant's service so far (0 for a tenant never seen)."""
        return self.counters.get(tenant, 0.0)

    def num_waiting(self, tenant: str) -> int:
        return self._num_waiting[tenant]

    def check_counts(self, waiting: list[str], live: list[str]) -> None:
        """Assert the tenant counts match the tenants of the waiting and live requests."""
        assert +self._num_waiting == Counter(waiting), (self._num_waiting, waiting)
        assert +self._num_live == Counter(live), (self._num_live, live)

    def arrived(self, tenant: str) -> None:
        """A new request of ``tenant`` enters the engine (and its waiting queue): lift the
        tenant's counter if it had nothing waiting (VTC's Algorithm 2)."""
        if self._num_live[tenant] == 0:
            self.counters[tenant] = self._idle.pop(tenant, self.counters.get(tenant, 0.0))
        self._num_live[tenant] += 1
        if self._num_waiting[tenant] == 0:
            waiting = [self.counter(t) for t, n in self._num_waiting.items() if n > 0]
            floor = min(waiting) if waiting else self._last_emptied
            self.counters[tenant] = max(self.counter(tenant), floor)
        self._num_waiting[tenant] += 1

    def requeued(self, tenant: str) -> None:
        """A preempted request of ``tenant`` returns to the waiting queue (no lift: the
        tenant was being served, not away)."""
        self._num_waiting[tenant] += 1

    def left_waiting(self, tenant: str) -> None:
        """A request of ``tenant`` left the waiting queue (admitted, or ended there)."""
        self._num_waiting[tenant] -= 1
        if self._num_waiting[tenant] <= 0:
            del self._num_waiting[tenant]
            self._last_emptied = self.counter(tenant)

    def left_engine(self, tenant: str) -> None:
        """A request of ``tenant`` finished (any status); a tenant with no request left keeps
        its counter among the ``MAX_IDLE_TENANTS`` most recent idle ones."""
        self._num_live[tenant] -= 1
        if self._num_live[tenant] > 0:
            return
        del self._num_live[tenant]
        self._idle[tenant] = self.counters.pop(tenant, 0.0)
        while len(self._idle) > MAX_IDLE_TENANTS:
            self._idle.popitem(last=False)

    def charge(self, tenant: str, num_prefill_tokens: int = 0, num_output_tokens: int = 0) -> None:
        """Add the service of ``num_prefill_tokens`` computed prompt tokens and
        ``num_output_tokens`` sampled tokens to the tenant's counter."""
        self.counters[tenant] = (
            self.counter(tenant)
            + PREFILL_TOKEN_WEIGHT * num_prefill_tokens
            + OUTPUT_TOKEN_WEIGHT * num_output_tokens
        )
