"""The expert-parallel sizes a routed-expert count splits into: a serving engine places
n_physical_experts / ep_size experts on each rank and refuses a count that the size does not
divide (vLLM #52435: `n_physical_experts=256 must be divisible by ep_size=3`). One rule for
`reap`, which refuses such a keep, and the audit's serve check, which fails such an output."""

from __future__ import annotations

# Expert-parallel sizes a serving layout commonly takes (GPUs of one node, two nodes of 8).
COMMON_EP_SIZES = (2, 4, 8, 16)
EP_SIZES = range(1, 17)
# The step between the counts suggested instead of an uneven one: what a node of 8 GPUs (and
# so EP 2 and 4) splits; the nearest multiples of 16 are often far (keep 5 of 16: only 16).
NODE_STEP = 8


def ep_divisors(count: int) -> list[int]:
    """The expert-parallel sizes 1-16 that split `count` experts evenly."""
    return [e for e in EP_SIZES if count % e == 0]


def splits_on_common_ep(count: int) -> bool:
    """Whether some common expert-parallel size (2, 4, 8 or 16) divides `count`."""
    return bool(set(ep_divisors(count)) & set(COMMON_EP_SIZES))


def prime_factors(count: int) -> list[int]:
    """`count`'s prime factors, ascending, repeated as often as they divide it."""
    out, rest, p = [], count, 2
    while p * p <= rest:
        while rest % p == 0:
            out.append(p)
            rest //= p
        p += 1
    return [*out, rest] if rest > 1 else out


def even_counts_near(count: int, low: int, high: int) -> list[int]:
    """The counts within [low, high] that EP 2, 4 and 8 divide, nearest `count` above and below
    (the one above first); where neither is in range, the neighbours some common size
    divides."""
    above, below = -(-count // NODE_STEP) * NODE_STEP, count // NODE_STEP * NODE_STEP
    found = [c for c in dict.fromkeys((above, below)) if low <= c <= high]
    return found or [c for c in (count + 1, count - 1)
                     if low <= c <= high and splits_on_common_ep(c)]


def uneven_ep_reason(count: int) -> str:
    """Why no common expert-parallel size splits `count` experts, with the sizes that do:
    'no expert-parallel size of 2, 4, 8 or 16 divides it (255 = 3 x 5 x 17; only 1, 3, 5, 15
    do)'."""
    factors = prime_factors(count)
    spelled = f"{count} = {' x '.join(map(str, factors))}" if len(factors) > 1 else (
        f"{count} is prime" if factors else f"{count}")
    common = ", ".join(map(str, COMMON_EP_SIZES[:-1])) + f" or {COMMON_EP_SIZES[-1]}"
    return (f"no expert-parallel size of {common} divides it ({spelled}; only "
            f"{', '.join(map(str, ep_divisors(count)))} do)")
