"""Seed 002's Horovod + PyTorch script (gradient compression with ``hvd.Compression.fp16``).

Run:  phalanx run -np 2 python examples/horovod_seed_002.py

The only Horovod-related change is the import line (``import horovod.torch as hvd`` in the
seed). The rest differs from the seed only where the seed elides or assumes a GPU: the model
and data it leaves as ``...`` are filled in (an MLP on the digits), ``set_device`` is guarded
so that it runs on a CPU-only machine, it trains 20 epochs instead of 100, and it prints the
test accuracy at the end.
"""

import torch

import phalanx.horovod.torch as hvd  # was: import horovod.torch as hvd
from phalanx.demo import load_digits

hvd.init()
# 配置GPU
if torch.cuda.is_available():
    torch.cuda.set_device(hvd.local_rank())
device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
# 模型、数据、损失函数 (filled in: an MLP on the digits that ship with scikit-learn)
torch.manual_seed(hvd.rank())  # different on purpose: broadcast_parameters must fix it
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)).to(device)
x_train, y_train, x_test, y_test = load_digits()
dataset = torch.utils.data.TensorDataset(x_train, y_train)
sampler = torch.utils.data.distributed.DistributedSampler(dataset, num_replicas=hvd.size(), rank=hvd.rank())
train_loader = torch.utils.data.DataLoader(dataset, batch_size=32, sampler=sampler)  # 用DistributedSampler分片
criterion = torch.nn.CrossEntropyLoss()
# 优化器:用Horovod包装,并启用量化
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
optimizer = hvd.DistributedOptimizer(
    optimizer,
    named_parameters=model.named_parameters(),
    compression=hvd.Compression.fp16  # 启用FP16量化压缩
)
# 广播初始参数
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
# 训练循环
model.train()
epochs = 20  # the seed runs 100; 20 is enough to see it learn
for epoch in range(epochs):
    for batch_idx, (data, target) in enumerate(train_loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        output = model(data)
        loss = criterion(output, target)
        loss.backward()
        optimizer.step()  # Horovod自动处理量化梯度的AllReduce
        if batch_idx % 100 == 0 and hvd.rank() == 0:
            print(f'Epoch {epoch}, Batch {batch_idx}, Loss {loss.item()}')

with torch.no_grad():
    accuracy = (model(x_test.to(device)).argmax(1) == y_test.to(device)).float().mean().item()
if hvd.rank() == 0:
    print(f"test accuracy {accuracy:.4f}")
