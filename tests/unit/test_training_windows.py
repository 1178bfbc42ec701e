"""Where the trained examples' training windows begin and in which order they are visited
(no training here: the windows are plain offsets)."""

import itertools

import torch

from moepipe.examples.train import Recipe, _batches, window_starts


def test_windows_begin_at_paragraphs_and_leave_no_token_out():
    recipe = Recipe(seq_len=16, window_stride=8)
    paragraphs = [0, 5, 40, 41, 90]  # a long paragraph 5..40, a one-token one at 40
    length = 100
    starts = window_starts(paragraphs, length, recipe)
    assert set(paragraphs[:-1]) <= set(starts)  # 90 does not fit a whole window: clipped
    assert max(starts) == length - recipe.seq_len - 1 and starts == sorted(set(starts))
    covered = {t for s in starts for t in range(s, s + recipe.seq_len + 1)}
    assert covered == set(range(length))


def test_batches_are_seeded_epochs_over_all_starts():
    recipe = Recipe(batch_size=4)
    starts = list(range(0, 100, 10))  # 10 starts: an epoch is 2.5 batches

    def draw(seed, count):
        gen = torch.Generator().manual_seed(seed)
        return [b.flatten().tolist() for b in itertools.islice(_batches(starts, recipe, gen),
                                                               count)]

    first = draw(7, 5)  # 20 windows: two epochs
    assert all(len(b) == recipe.batch_size for b in first)
    flat = [s for b in first for s in b]
    assert sorted(flat[:10]) == starts and sorted(flat[10:]) == starts
    assert draw(7, 5) == first and draw(8, 5) != first
