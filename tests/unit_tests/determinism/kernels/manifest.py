"""Every kernel-bearing source of the project, with the tests that replay it bit for bit.

Standard library only: ``tools/check_kernel_determinism_coverage.py`` reads this file without
importing the project. One entry per kernel family:

- ``name``: unique;
- ``sources``: repository-relative files whose code defines or builds the family's kernels;
- ``tests``: pytest node ids (``file::test``) of its replay tests;
- ``kind``: ``triton``, ``compiled-torch``, ``torch-library`` or ``transformer-engine``;
- ``exempt``: None, or the reason a family has no replay test (none has one today).
"""

_REPLAY = "tests/unit_tests/determinism/kernels/test_replay.py"

KERNELS = [
    {
        "name": "triton-activation-kernels",
        "sources": [
            "mcore_activations/fusions/triton_jit.py",
            "mcore_activations/fusions/triton_plans.py",
            "mcore_activations/fusions/triton_kernels.py",
        ],
        "tests": [
            f"{_REPLAY}::test_triton_kernels_replay_bitwise",
            f"{_REPLAY}::test_ops_replay_in_a_fresh_process",
            f"{_REPLAY}::test_cuda_triton_replay_bitwise",
            f"{_REPLAY}::test_cuda_ops_replay_in_a_fresh_process",
        ],
        "kind": "triton",
        "exempt": None,
    },
    {
        "name": "torch-activation-kernels",
        "sources": ["mcore_activations/fusions/activation_kernels.py"],
        "tests": [
            f"{_REPLAY}::test_torch_backends_replay_bitwise",
            f"{_REPLAY}::test_ops_replay_in_a_fresh_process",
        ],
        "kind": "compiled-torch",
        "exempt": None,
    },
    {
        "name": "activation-ops",
        "sources": ["mcore_activations/fusions/activation_ops.py"],
        "tests": [
            f"{_REPLAY}::test_ops_replay_in_a_fresh_process",
            f"{_REPLAY}::test_cuda_ops_replay_in_a_fresh_process",
        ],
        "kind": "torch-library",
        "exempt": None,
    },
    {
        "name": "upstream-jit-callables",
        "sources": [
            "mcore_activations/activations.py",
            "mcore_activations/fusions/fused_bias_geglu.py",
            "mcore_activations/jit.py",
        ],
        "tests": [
            f"{_REPLAY}::test_jit_fuser_callables_replay_bitwise",
            f"{_REPLAY}::test_cuda_ops_replay_in_a_fresh_process",
        ],
        "kind": "compiled-torch",
        "exempt": None,
    },
    {
        "name": "te-fused-mlps",
        "sources": [
            "mcore_activations/te_lowering.py",
            "megatron/core/extensions/te_fused_mlp.py",
            "megatron/core/extensions/te_ops_adapters.py",
        ],
        "tests": [f"{_REPLAY}::test_cuda_te_fused_mlp_replay_bitwise"],
        "kind": "transformer-engine",
        "exempt": None,
    },
    {
        "name": "te-fused-residual-rmsnorm",
        "sources": [
            "megatron/core/extensions/te_norm.py",
            "megatron/core/extensions/te_ops_adapters.py",
        ],
        "tests": [f"{_REPLAY}::test_cuda_te_fused_residual_rmsnorm_replay_bitwise"],
        "kind": "transformer-engine",
        "exempt": None,
    },
    {
        "name": "te-grouped-experts",
        "sources": [
            "megatron/core/transformer/moe/experts.py",
            "megatron/core/transformer/moe/shared_experts.py",
        ],
        "tests": [
            f"{_REPLAY}::test_cuda_te_grouped_mlp_replay_bitwise",
            f"{_REPLAY}::test_cuda_te_fused_mlp_replay_bitwise",
        ],
        "kind": "transformer-engine",
        "exempt": None,
    },
]
