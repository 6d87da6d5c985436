"""The word problems of `lm eval state-tracking`: permutation groups and uniformly drawn words with their running
products.

A word is x_1 .. x_T of group elements; its running product is p_t = x_1 x_2 ... x_t (apply x_1 first), the target at
every position. Parity is the word problem of S2 (a swap flips it, the identity keeps it); S3 (6 elements, not
abelian), A5 (60, the smallest simple non-abelian group) and S5 (120, not solvable) are the groups of the
negative-eigenvalue (Grazzi et al., arXiv 2411.12537) and DeltaProduct (Siems et al., arXiv 2502.10297) papers.
"""

import functools
import itertools

import torch

# task -> (n of the permutation group on n points, whether only its even permutations: A_n)
TASKS = {"parity": (2, False), "s3": (3, False), "a5": (5, True), "s5": (5, False)}


def is_even(permutation: tuple[int, ...]) -> bool:
    """Whether `permutation` is a product of an even number of swaps (its inversions counted)."""
    return sum(a > b for a, b in itertools.combinations(permutation, 2)) % 2 == 0


@functools.cache
def group(task: str) -> tuple[torch.Tensor, list[tuple[int, ...]]]:
    """(the multiplication table [|G|, |G|] of the task's group, its elements): table[a, b] is the permutation a
    then b."""
    n, even_only = TASKS[task]
    elements = [p for p in itertools.permutations(range(n)) if is_even(p) or not even_only]
    index = {p: i for i, p in enumerate(elements)}
    table = torch.tensor([[index[tuple(b[a[i]] for i in range(n))] for b in elements] for a in elements])
    return table, elements


def running_products(task: str, x: torch.Tensor) -> torch.Tensor:
    """The running products [batch, length] of words of element indices x [batch, length]: p_t = x_1 ... x_t."""
    table, _ = group(task)
    products = [x[:, 0]]
    for t in range(1, x.shape[1]):
        products.append(table[products[-1], x[:, t]])
    return torch.stack(products, dim=1)


def words(task: str, batch: int, length: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(elements [batch, length], running products [batch, length]) of uniformly drawn words."""
    x = torch.randint(len(group(task)[1]), (batch, length), generator=generator)
    return x, running_products(task, x)


def chance(task: str) -> float:
    """The accuracy of a guess at one position: one over the group's order."""
    return 1 / len(group(task)[1])
