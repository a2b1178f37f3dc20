"""The tiny parity config the sweep tests plan and train (4 steps of a 1-layer model), and their grid."""

TINY = """
[task]
name = "parity"
max_train_length = 6
train_size = 48
valid_size = 24
test_size = 16
length_generalisation_size = 16
seed = 5

[model]
kind = "encoder_classifier"
layers = 1
d_model = 8
heads = 2
d_ff = 16
dropout = 0.0

[train]
steps = 4
batch_size = 8
log_every = 2
eval_every = 0
checkpoint_every = 0
"""

GRID = ["model.attention=soft,hard", "model.positional=sinusoidal,none"]
