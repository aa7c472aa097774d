"""The dispatch counter (treelit.utils.dispatch): what it calls a launch, a sync and an upload."""

import numpy as np
import torch

from treelit.utils.dispatch import DispatchCounter


def test_views_and_allocations_are_not_launches_but_arithmetic_is():
    x = torch.randn(6, 4)
    with DispatchCounter() as c:
        y = x.view(4, 6).transpose(0, 1)[1:]
        torch.empty(3)
        z = y * 2 + 1
    assert z.shape == (5, 4)
    assert c.counts.launches == 2 and c.counts.ops == {"mul": 1, "add": 1}
    assert c.counts.syncs == 0 and c.counts.uploads == 0


def test_host_reads_of_device_values_are_syncs():
    x = torch.randn(8, 3)
    with DispatchCounter() as c:
        x.sum().item()
        x[x > 0]
        torch.nonzero(x)
        x[0].tolist()
        x[1].numpy()
        bool(x[0, 0] > 0)
    assert c.counts.sync_ops == {"_local_scalar_dense": 2, "index": 1, "nonzero": 1, "tolist": 1, "numpy": 1}
    assert c.counts.syncs == 6 and c.counts.uploads == 0


def test_host_data_is_one_upload_when_a_device_operator_first_reads_it_and_host_planning_is_free():
    x = torch.randn(10, 2, requires_grad=True)
    with DispatchCounter() as c:
        idx = torch.from_numpy(np.arange(4)) * 2 + 1  # planned on the host: no launch, no upload yet
        plan = idx.tolist()  # host data read by the host: no sync
        y = x[idx]  # the device reads it: one upload
        x[idx].sum().backward()  # already uploaded
        torch.tensor([1.0, 2.0])  # made but never read by the device: nothing moves
    assert plan == [1, 3, 5, 7] and y.shape == (4, 2)
    assert c.counts.uploads == 1
    assert c.counts.syncs == 0
    assert c.counts.launches >= 4 and "mul" not in c.counts.ops


def test_a_boolean_mask_in_a_backward_counts_as_a_sync():
    x = torch.randn(5, requires_grad=True)
    m = x.detach() > 0
    with DispatchCounter() as c:
        x[m].sum().backward()
    assert c.counts.sync_ops["index"] == 1 and c.counts.sync_ops["index_put"] == 1


def test_a_planned_buffer_moved_once_is_one_upload_however_many_views_are_read():
    x = torch.randn(10, 2)
    with DispatchCounter() as c:
        plan = torch.from_numpy(np.arange(8)).to("cpu", non_blocking=True)
        for j in range(4):
            x[plan[2 * j: 2 * j + 2]]
    assert c.counts.uploads == 1
    with DispatchCounter() as c:  # without the move, every view read by the device is its own upload
        plan = torch.from_numpy(np.arange(8))
        for j in range(4):
            x[plan[2 * j: 2 * j + 2]]
    assert c.counts.uploads == 4


def test_as_tensor_of_a_device_tensor_is_no_upload():
    x = torch.randn(4)
    with DispatchCounter() as c:
        (torch.as_tensor(x) * 2).sum()
    assert c.counts.uploads == 0 and c.counts.launches == 2


def test_the_counter_leaves_torch_as_it_found_it():
    before_tensor, before_torch = dict(torch.Tensor.__dict__), {n: getattr(torch, n) for n in ("from_numpy", "tensor")}
    with DispatchCounter():
        torch.ones(2).tolist()
    assert dict(torch.Tensor.__dict__) == before_tensor
    assert all(getattr(torch, n) is f for n, f in before_torch.items())


def test_upload_all_is_one_upload_of_views_in_each_arrays_shape():
    from treelit.utils.dispatch import upload_all

    x = torch.randn(12)
    arrays = [np.arange(6).reshape(2, 3), np.array([1, 0]), np.zeros((0,), np.int64)]
    with DispatchCounter() as c:
        views = upload_all(arrays, "cpu")
        x[views[0]].sum() + x[views[1]].sum()
    assert c.counts.uploads == 1
    assert [tuple(v.shape) for v in views] == [(2, 3), (2,), (0,)]
    assert all(np.array_equal(v.numpy(), a) for v, a in zip(views, arrays))
