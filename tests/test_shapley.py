"""knn_shapley against the definition: eq. (1) with the utility of eq. (2), by enumeration."""

import itertools
import math

import pytest
import torch

from learner import knn_shapley
from learner.memory.shapley import order_by_distance


def shapley_by_enumeration(ev, ev_y, cand, cand_y, k):
    """Eq. (1): s(i) = 1/N sum_{S subset I\\{i}} [v(S u {i}) - v(S)] / C(N-1, |S|)."""
    n = cand.shape[0]
    out = torch.zeros(ev.shape[0], n, dtype=torch.float64)
    for j in range(ev.shape[0]):
        dist = ((cand - ev[j]) ** 2).sum(1).sqrt()
        rank = {i: r for r, i in enumerate(sorted(range(n), key=lambda i: (float(dist[i]), i)))}

        def utility(subset):  # eq. (2)
            nearest = sorted(subset, key=rank.__getitem__)[:k]
            return sum(1.0 for i in nearest if cand_y[i] == ev_y[j]) / k

        for i in range(n):
            others = [x for x in range(n) if x != i]
            total = 0.0
            for size in range(n):
                for subset in itertools.combinations(others, size):
                    total += (utility(subset + (i,)) - utility(subset)) / math.comb(n - 1, size)
            out[j, i] = total / n
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])  # float32 on the CPU: the int64-key sort
@pytest.mark.parametrize("seed", range(12))
def test_matches_enumeration_on_random_sets(seed, dtype):
    g = torch.Generator().manual_seed(seed)
    n_cand = int(torch.randint(1, 8, (1,), generator=g))
    n_eval = int(torch.randint(1, 5, (1,), generator=g))
    k = int(torch.randint(1, 6, (1,), generator=g))  # includes K > N_c
    cand = torch.randn(n_cand, 4, generator=g, dtype=torch.float64)
    ev = torch.randn(n_eval, 4, generator=g, dtype=torch.float64)
    cand_y = torch.randint(0, 3, (n_cand,), generator=g)
    ev_y = torch.randint(0, 3, (n_eval,), generator=g)
    expected = shapley_by_enumeration(ev, ev_y, cand, cand_y, k)
    got = knn_shapley(ev.to(dtype), ev_y, cand.to(dtype), cand_y, k)
    assert torch.allclose(got.double(), expected, atol=1e-12 if dtype == torch.float64 else 1e-6)


@pytest.mark.parametrize("seed", range(4))
def test_the_fast_order_is_torchs_stable_sort(seed):
    g = torch.Generator().manual_seed(seed)
    dist = torch.randint(0, 6, (64, 300), generator=g).float() / 4  # many exact ties, zeros among them
    dist[0, :7] = -0.0  # ties with 0.0 as torch.sort has it
    dist[1, 5] = float("inf")
    assert torch.equal(order_by_distance(dist), torch.sort(dist, dim=1, stable=True).indices)
    real = torch.cdist(torch.randn(50, 8, generator=g), torch.randn(400, 8, generator=g))
    assert torch.equal(order_by_distance(real), torch.sort(real, dim=1, stable=True).indices)


def test_ties_are_broken_by_candidate_index():
    ev = torch.zeros(1, 2, dtype=torch.float64)
    cand = torch.ones(4, 2, dtype=torch.float64)  # all equidistant
    cand_y = torch.tensor([1, 0, 1, 0])
    ev_y = torch.tensor([0])
    got = knn_shapley(ev, ev_y, cand, cand_y, 1)
    assert torch.allclose(got, shapley_by_enumeration(ev, ev_y, cand, cand_y, 1), atol=1e-12)
    # with K=1 the lower-indexed of two equidistant matching candidates counts as the nearer
    assert got[0, 1] > got[0, 3] > 0


def test_efficiency_sums_to_utility_of_the_full_set():
    g = torch.Generator().manual_seed(3)
    cand, ev = torch.randn(40, 8, generator=g), torch.randn(6, 8, generator=g)
    cand_y, ev_y = torch.randint(0, 4, (40,), generator=g), torch.randint(0, 4, (6,), generator=g)
    k = 5
    values = knn_shapley(ev, ev_y, cand, cand_y, k)
    nearest = torch.sort(torch.cdist(ev, cand), dim=1, stable=True).indices[:, :k]
    full_utility = (cand_y[nearest] == ev_y[:, None]).float().sum(1) / k
    assert torch.allclose(values.sum(1), full_utility, atol=1e-5)


def test_signs_follow_property_1():
    g = torch.Generator().manual_seed(5)
    cand, ev = torch.randn(30, 3, generator=g), torch.randn(4, 3, generator=g)
    cand_y, ev_y = torch.randint(0, 2, (30,), generator=g), torch.randint(0, 2, (4,), generator=g)
    values = knn_shapley(ev, ev_y, cand, cand_y, 3)
    same = cand_y[None, :] == ev_y[:, None]
    assert (values[same] > 0).all()
    assert (values[~same] <= 0).all()


def test_shapes_dtype_and_empty_inputs():
    ev, cand = torch.randn(3, 5), torch.randn(7, 5)
    out = knn_shapley(ev, torch.zeros(3, dtype=torch.long), cand, torch.zeros(7, dtype=torch.long), 2)
    assert out.shape == (3, 7) and out.dtype == torch.float32
    assert knn_shapley(ev[:0], torch.zeros(0, dtype=torch.long), cand, torch.zeros(7, dtype=torch.long), 2).shape == (0, 7)
    with pytest.raises(ValueError):
        knn_shapley(ev, torch.zeros(3, dtype=torch.long), cand, torch.zeros(7, dtype=torch.long), 0)


@pytest.mark.parametrize("seed", [0, 1])
def test_a_memory_reference_values_each_batch_as_knn_shapley_defines_it(seed):
    """`MemoryReference.values_of` (the memory's distances to itself computed once, for many batches) gives each
    incoming sample its mean KNN-SV over the remembered samples as evaluation points, each point's candidates the
    batch and the other remembered samples (eqs. 3-4, computed directly)."""
    from learner.memory.shapley import MemoryReference

    g = torch.Generator().manual_seed(seed)
    memory, labels = torch.randn(40, 6, generator=g), torch.randint(0, 3, (40,), generator=g)
    reference = MemoryReference(memory, labels, k=3)
    for _ in range(3):
        batch, given = torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)
        direct = torch.stack([knn_shapley(memory[j:j + 1], labels[j:j + 1],
                                          torch.cat([batch, memory[torch.arange(40) != j]]),
                                          torch.cat([given, labels[torch.arange(40) != j]]), k=3)[0, :5]
                              for j in range(40)]).mean(0)
        assert torch.allclose(reference.values_of(batch, given), direct, atol=1e-6)
