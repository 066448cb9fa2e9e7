# The inputs docs/python.md's distributed example takes as given, in a world of 2 gloo
# processes: this prelude forks rank 1 before torch starts any thread, both ranks run the
# example on the same replicated inputs (same seed), and rank 0 exits 1 unless rank 1
# succeeded. Small sizes: H = 64, so N = 18H = 1152 splits into 64-row chunks per rank.
import atexit
import os
import socket

import torch

import detdit

WORLD = 2
with socket.socket() as sock:  # a free port for the rendezvous
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(WORLD))
child = os.fork()
rank = 1 if child == 0 else 0
os.environ["RANK"] = str(rank)
if child:
    def _rank_1_succeeded():
        _, status = os.waitpid(child, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            os._exit(1)
    atexit.register(_rank_1_succeeded)

torch.manual_seed(0)
T, B, S, H, D = 2, 2, 10, 64, 32
N = 18 * H
rows = slice(rank * N // WORLD, (rank + 1) * N // WORLD)
temb = torch.randn(T, D)
weight, bias = torch.randn(N, D, dtype=torch.bfloat16), torch.randn(N, dtype=torch.bfloat16)
plan = detdit.plan(torch.randint(0, T, (S,)), torch.randint(0, 3, (S,)), num_timesteps=T, batch=B)
x = torch.randn(B, S, H, dtype=torch.bfloat16)
norm1_weight, norm2_weight = torch.randn(2, H, dtype=torch.bfloat16).unbind(0)
shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = torch.randn(6, 3 * T, H, dtype=torch.bfloat16).unbind(0)
attn = ffn = torch.nn.Identity()
