"""Horovod's canonical PyTorch pattern with the documented import: train, then ``metric_average``.

Run:  phalanx run -np 2 python examples/horovod_metric_average.py

This is the structure of Horovod's ``examples/pytorch/pytorch_mnist.py`` (shard the data,
wrap the optimizer, broadcast the initial state, average the test metrics over the ranks
with ``hvd.allreduce``) on a small synthetic classification task, so that it runs anywhere
in seconds. Only the import line differs from a Horovod script.
"""

import torch

import phalanx.horovod.torch as hvd  # was: import horovod.torch as hvd


def metric_average(val, name):
    tensor = torch.tensor(val)
    avg_tensor = hvd.allreduce(tensor, name=name)
    return avg_tensor.item()


def data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, :4].sum(1) > x[:, 4:].sum(1)).long()
    return x, y


hvd.init()
torch.manual_seed(hvd.rank())  # different on purpose: broadcast_parameters aligns the replicas
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
x_train, y_train = data(1024, seed=0)
x_test, y_test = data(256, seed=1)
train = torch.utils.data.TensorDataset(x_train, y_train)
sampler = torch.utils.data.distributed.DistributedSampler(train, num_replicas=hvd.size(), rank=hvd.rank())
loader = torch.utils.data.DataLoader(train, batch_size=32, sampler=sampler)

optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size(), momentum=0.9)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

for epoch in range(5):
    model.train()
    sampler.set_epoch(epoch)
    for x, y in loader:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

# each rank evaluates its shard of the test set, then the metrics are averaged over the ranks
model.eval()
shard = slice(hvd.rank(), None, hvd.size())
with torch.no_grad():
    logits = model(x_test[shard])
    test_loss = torch.nn.functional.cross_entropy(logits, y_test[shard]).item()
    test_accuracy = (logits.argmax(1) == y_test[shard]).float().mean().item()
print(f"rank {hvd.rank()} local test loss {test_loss:.6f} accuracy {test_accuracy:.6f}", flush=True)
test_loss = metric_average(test_loss, "avg_loss")
test_accuracy = metric_average(test_accuracy, "avg_accuracy")
if hvd.rank() == 0:
    print(f"Test set: Average loss: {test_loss:.6f}, Accuracy: {test_accuracy:.6f}", flush=True)
