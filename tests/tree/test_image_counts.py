"""A tree's image counts (what the start-up line and the summary report): the images the branches
show, the distinct ones the tree encodes, and those several branches share."""

from __future__ import annotations

import torch

import treelit
from treelit.tree.images import ProcessedImage, image_counts


def _image(seed: int) -> ProcessedImage:
    g = torch.Generator().manual_seed(seed)
    return ProcessedImage(pixel_values=torch.randn(4, 3, generator=g), grid_thw=(1, 2, 2), num_tokens=1, token_id=99)


def test_distinct_and_shared_images_of_a_tree():
    a, b, c = _image(0), _image(1), _image(2)
    branches = [[1, 99, 2, 3], [1, 99, 2, 4, 99, 5], [1, 99, 6]]
    tree = treelit.TokenTree.from_branches(branches, images=[[a], [a, b], [c]])
    # a: shown by branches 0 and 1 (one span); b by branch 1; c by branch 2
    assert image_counts(tree) == {"images": 4, "distinct_images": 3, "shared_images": 1}


def test_the_same_image_in_two_places_is_one_distinct_image_shown_twice():
    a = _image(0)
    tree = treelit.TokenTree.from_branches([[1, 99, 2], [3, 99, 4]], images=[[a], [a]])
    assert image_counts(tree) == {"images": 2, "distinct_images": 1, "shared_images": 1}


def test_a_text_tree_has_no_images():
    tree = treelit.TokenTree.from_branches([[1, 2, 3], [1, 2, 4]])
    assert image_counts(tree) == {"images": 0, "distinct_images": 0, "shared_images": 0}
