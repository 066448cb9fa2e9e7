# The inputs docs/python.md's "Use" example takes as given: h3_conditioning.safetensors (the
# synthetic default, one block, 0.64 GB, written by the CLI into the working directory) and a
# short packed sequence at the H3 sizes, with identity sublayers.
import os
import subprocess

import torch

import detdit

if not os.path.exists("h3_conditioning.safetensors"):
    subprocess.run([os.path.join("build", "detdit"), "weights", "synth", "--out", "."], check=True)
torch.manual_seed(0)
T, B, S = 2, 1, 24
t = torch.rand(T)
timestep_indices, token_tags = torch.randint(0, T, (S,)), torch.randint(0, 3, (S,))
x = torch.randn(B, S, detdit.H3_HIDDEN_SIZE, dtype=torch.bfloat16)
attn = ffn = torch.nn.Identity()
