"""Golden listings of the annotated graphs and the generated runtime of the two-tower model.

They pin what every pass decided, node by node. After an intended change, refresh them with
``EXPECTTEST_ACCEPT=1 python -m pytest tests/test_golden.py`` and review the diff.
"""

import torch
from expecttest import TestCase

import apollo_compile
from apollo_compile.report import dump
from models import TwoTower, two_tower_inputs


def compile_tiny_two_tower():
    torch.manual_seed(0)
    model = TwoTower(width=16, embed=8, layers=1)
    compiled = torch.compile(model, backend="apollo", options={"subgraph_compiler": "eager", "device": "H200"})
    compiled(*two_tower_inputs(batch=2)).backward()
    return apollo_compile.last_plan()


class TestGolden(TestCase):
    def setUp(self):
        torch._dynamo.reset()
        self.plan = compile_tiny_two_tower()

    def test_forward_listing(self):
        self.assertExpectedInline(self.plan.forward.listing, """\
# apollo frame0_0_forward (forward) planned for H200
node                                           op                                                   value                                        modality  lane/sg  flops  bytes   AI  bound   est_us  mark
primals_1                                      placeholder                                          f32[16, 3, 8, 8]                             vision    -            0      0    -  -         0.00
primals_2                                      placeholder                                          f32[16]                                      vision    -            0      0    -  -         0.00
primals_3                                      placeholder                                          f32[2, 3, 16, 16]                            vision    -            0      0    -  -         0.00
primals_4                                      placeholder                                          f32[1, 4, 16]                                vision    -            0      0    -  -         0.00
primals_5                                      placeholder                                          f32[16]                                      vision    -            0      0    -  -         0.00
primals_6                                      placeholder                                          f32[16]                                      vision    -            0      0    -  -         0.00
primals_7                                      placeholder                                          f32[48, 16]                                  vision    -            0      0    -  -         0.00
primals_8                                      placeholder                                          f32[48]                                      vision    -            0      0    -  -         0.00
primals_9                                      placeholder                                          f32[16, 16]                                  vision    -            0      0    -  -         0.00
primals_10                                     placeholder                                          f32[16]                                      vision    -            0      0    -  -         0.00
primals_11                                     placeholder                                          f32[16]                                      vision    -            0      0    -  -         0.00
primals_12                                     placeholder                                          f32[16]                                      vision    -            0      0    -  -         0.00
primals_13                                     placeholder                                          f32[64, 16]                                  vision    -            0      0    -  -         0.00
primals_14                                     placeholder                                          f32[64]                                      vision    -            0      0    -  -         0.00
primals_15                                     placeholder                                          f32[16, 64]                                  vision    -            0      0    -  -         0.00
primals_16                                     placeholder                                          f32[16]                                      vision    -            0      0    -  -         0.00
primals_17                                     placeholder                                          f32[16]                                      vision    -            0      0    -  -         0.00
primals_18                                     placeholder                                          f32[16]                                      vision    -            0      0    -  -         0.00
primals_19                                     placeholder                                          f32[8, 16]                                   vision    -            0      0    -  -         0.00
primals_20                                     placeholder                                          f32[64, 16]                                  text      -            0      0    -  -         0.00
primals_21                                     placeholder                                          i64[2, 8]                                    text      -            0      0    -  -         0.00
primals_22                                     placeholder                                          f32[1, 8, 16]                                text      -            0      0    -  -         0.00
primals_23                                     placeholder                                          f32[16]                                      text      -            0      0    -  -         0.00
primals_24                                     placeholder                                          f32[16]                                      text      -            0      0    -  -         0.00
primals_25                                     placeholder                                          f32[48, 16]                                  text      -            0      0    -  -         0.00
primals_26                                     placeholder                                          f32[48]                                      text      -            0      0    -  -         0.00
primals_27                                     placeholder                                          f32[16, 16]                                  text      -            0      0    -  -         0.00
primals_28                                     placeholder                                          f32[16]                                      text      -            0      0    -  -         0.00
primals_29                                     placeholder                                          f32[16]                                      text      -            0      0    -  -         0.00
primals_30                                     placeholder                                          f32[16]                                      text      -            0      0    -  -         0.00
primals_31                                     placeholder                                          f32[64, 16]                                  text      -            0      0    -  -         0.00
primals_32                                     placeholder                                          f32[64]                                      text      -            0      0    -  -         0.00
primals_33                                     placeholder                                          f32[16, 64]                                  text      -            0      0    -  -         0.00
primals_34                                     placeholder                                          f32[16]                                      text      -            0      0    -  -         0.00
primals_35                                     placeholder                                          f32[16]                                      text      -            0      0    -  -         0.00
primals_36                                     placeholder                                          f32[16]                                      text      -            0      0    -  -         0.00
primals_37                                     placeholder                                          f32[8, 16]                                   text      -            0      0    -  -         0.00
primals_38                                     placeholder                                          f32[]                                        vision    -            0      0    -  -         0.00
convolution                                    convolution.default                                  f32[2, 16, 2, 2]                             vision    0/0      49152  19008  2.6  memory    2.00
view                                           view.default                                         f32[2, 16, 4]                                vision    0/0          0      0    -  -         0.00
transpose                                      transpose.int                                        f32[2, 4, 16]                                vision    0/0          0      0    -  -         0.00
add                                            add.Tensor                                           f32[2, 4, 16]                                vision    0/0        128   1280  0.1  memory    2.00
native_layer_norm                              native_layer_norm.default                            (f32[2, 4, 16], f32[2, 4, 1], f32[2, 4, 1])  vision    0/0        144   1216  0.1  memory    2.00
getitem                                        getitem[0]                                           f32[2, 4, 16]                                vision    0/0          0      0    -  -         0.00
getitem_1                                      getitem[1]                                           f32[2, 4, 1]                                 vision    0/0          0      0    -  -         0.00
getitem_2                                      getitem[2]                                           f32[2, 4, 1]                                 vision    0/0          0      0    -  -         0.00
view_1                                         view.default                                         f32[8, 16]                                   vision    0/0          0      0    -  -         0.00
t                                              t.default                                            f32[16, 48]                                  vision    0/0          0      0    -  -         0.00
addmm                                          addmm.default                                        f32[8, 48]                                   vision    0/0      12288   5312  2.3  memory    2.00
view_2                                         view.default                                         f32[2, 4, 48]                                vision    0/0          0      0    -  -         0.00
view_3                                         view.default                                         f32[2, 4, 3, 4, 4]                           vision    0/0          0      0    -  -         0.00
permute                                        permute.default                                      f32[3, 2, 4, 4, 4]                           vision    0/0          0      0    -  -         0.00
select                                         select.int                                           f32[2, 4, 4, 4]                              vision    0/0          0      0    -  -         0.00
select_1                                       select.int                                           f32[2, 4, 4, 4]                              vision    0/0          0      0    -  -         0.00
select_2                                       select.int                                           f32[2, 4, 4, 4]                              vision    0/0          0      0    -  -         0.00
_scaled_dot_product_flash_attention_for_cpu    _scaled_dot_product_flash_attention_for_cpu.default  (f32[2, 4, 4, 4], f32[2, 4, 4])              vision    0/0       2048   2176  0.9  memory    2.00
getitem_3                                      getitem[0]                                           f32[2, 4, 4, 4]                              vision    0/0          0      0    -  -         0.00
getitem_4                                      getitem[1]                                           f32[2, 4, 4]                                 vision    0/0          0      0    -  -         0.00
detach                                         detach.default                                       f32[2, 4, 4, 4]                              vision    0/0          0      0    -  -         0.00
transpose_1                                    transpose.int                                        f32[2, 4, 4, 4]                              vision    0/0          0      0    -  -         0.00
view_4                                         view.default                                         f32[2, 4, 16]                                vision    0/0          0      0    -  -         0.00
view_5                                         view.default                                         f32[8, 16]                                   vision    0/0          0      0    -  -         0.00
t_1                                            t.default                                            f32[16, 16]                                  vision    0/0          0      0    -  -         0.00
addmm_1                                        addmm.default                                        f32[8, 16]                                   vision    0/0       4096   2112  1.9  memory    2.00
view_6                                         view.default                                         f32[2, 4, 16]                                vision    0/0          0      0    -  -         0.00
clone                                          clone.default                                        f32[2, 4, 16]                                vision    0/0          0   1024  0.0  memory    2.00
add_1                                          add.Tensor                                           f32[2, 4, 16]                                vision    0/0        128   1536  0.1  memory    2.00
native_layer_norm_1                            native_layer_norm.default                            (f32[2, 4, 16], f32[2, 4, 1], f32[2, 4, 1])  vision    0/0        144   1216  0.1  memory    2.00
getitem_5                                      getitem[0]                                           f32[2, 4, 16]                                vision    0/0          0      0    -  -         0.00
getitem_6                                      getitem[1]                                           f32[2, 4, 1]                                 vision    0/0          0      0    -  -         0.00
getitem_7                                      getitem[2]                                           f32[2, 4, 1]                                 vision    0/0          0      0    -  -         0.00
view_7                                         view.default                                         f32[8, 16]                                   vision    0/0          0      0    -  -         0.00
t_2                                            t.default                                            f32[16, 64]                                  vision    0/0          0      0    -  -         0.00
addmm_2                                        addmm.default                                        f32[8, 64]                                   vision    0/0      16384   6912  2.4  memory    2.00
view_8                                         view.default                                         f32[2, 4, 64]                                vision    0/0          0      0    -  -         0.00
gelu                                           gelu.default                                         f32[2, 4, 64]                                vision    0/0        512   4096  0.1  memory    2.00
view_9                                         view.default                                         f32[8, 64]                                   vision    0/0          0      0    -  -         0.00
t_3                                            t.default                                            f32[64, 16]                                  vision    0/0          0      0    -  -         0.00
addmm_3                                        addmm.default                                        f32[8, 16]                                   vision    0/0      16384   6720  2.4  memory    2.00
view_10                                        view.default                                         f32[2, 4, 16]                                vision    0/0          0      0    -  -         0.00
clone_1                                        clone.default                                        f32[2, 4, 16]                                vision    0/0          0   1024  0.0  memory    2.00
add_2                                          add.Tensor                                           f32[2, 4, 16]                                vision    0/0        128   1536  0.1  memory    2.00
native_layer_norm_2                            native_layer_norm.default                            (f32[2, 4, 16], f32[2, 4, 1], f32[2, 4, 1])  vision    0/0        144   1216  0.1  memory    2.00
getitem_8                                      getitem[0]                                           f32[2, 4, 16]                                vision    0/0          0      0    -  -         0.00
getitem_9                                      getitem[1]                                           f32[2, 4, 1]                                 vision    0/0          0      0    -  -         0.00
getitem_10                                     getitem[2]                                           f32[2, 4, 1]                                 vision    0/0          0      0    -  -         0.00
mean                                           mean.dim                                             f32[2, 16]                                   vision    0/0        128    640  0.2  memory    2.00
t_4                                            t.default                                            f32[16, 8]                                   vision    0/0          0      0    -  -         0.00
mm                                             mm.default                                           f32[2, 8]                                    vision    0/0        512    704  0.7  memory    2.00
linalg_vector_norm                             linalg_vector_norm.default                           f32[2, 1]                                    vision    0/0         16     72  0.2  memory    2.00
clamp_min                                      clamp_min.default                                    f32[2, 1]                                    vision    0/0          2     16  0.1  memory    2.00
expand                                         expand.default                                       f32[2, 8]                                    vision    0/0          0      0    -  -         0.00
div                                            div.Tensor                                           f32[2, 8]                                    vision    0/0         16    192  0.1  memory    2.00
embedding                                      embedding.default                                    f32[2, 8, 16]                                text      1/1          0   5248  0.0  memory    2.00
add_3                                          add.Tensor                                           f32[2, 8, 16]                                text      1/1        256   2560  0.1  memory    2.00
native_layer_norm_3                            native_layer_norm.default                            (f32[2, 8, 16], f32[2, 8, 1], f32[2, 8, 1])  text      1/1        288   2304  0.1  memory    2.00
getitem_11                                     getitem[0]                                           f32[2, 8, 16]                                text      1/1          0      0    -  -         0.00
getitem_12                                     getitem[1]                                           f32[2, 8, 1]                                 text      1/1          0      0    -  -         0.00
getitem_13                                     getitem[2]                                           f32[2, 8, 1]                                 text      1/1          0      0    -  -         0.00
view_11                                        view.default                                         f32[16, 16]                                  text      1/1          0      0    -  -         0.00
t_5                                            t.default                                            f32[16, 48]                                  text      1/1          0      0    -  -         0.00
addmm_4                                        addmm.default                                        f32[16, 48]                                  text      1/1      24576   7360  3.3  memory    2.00
view_12                                        view.default                                         f32[2, 8, 48]                                text      1/1          0      0    -  -         0.00
view_13                                        view.default                                         f32[2, 8, 3, 4, 4]                           text      1/1          0      0    -  -         0.00
permute_1                                      permute.default                                      f32[3, 2, 4, 8, 4]                           text      1/1          0      0    -  -         0.00
select_3                                       select.int                                           f32[2, 4, 8, 4]                              text      1/1          0      0    -  -         0.00
select_4                                       select.int                                           f32[2, 4, 8, 4]                              text      1/1          0      0    -  -         0.00
select_5                                       select.int                                           f32[2, 4, 8, 4]                              text      1/1          0      0    -  -         0.00
_scaled_dot_product_flash_attention_for_cpu_1  _scaled_dot_product_flash_attention_for_cpu.default  (f32[2, 4, 8, 4], f32[2, 4, 8])              text      1/1       8192   4352  1.9  memory    2.00
getitem_14                                     getitem[0]                                           f32[2, 4, 8, 4]                              text      1/1          0      0    -  -         0.00
getitem_15                                     getitem[1]                                           f32[2, 4, 8]                                 text      1/1          0      0    -  -         0.00
detach_2                                       detach.default                                       f32[2, 4, 8, 4]                              text      1/1          0      0    -  -         0.00
transpose_2                                    transpose.int                                        f32[2, 8, 4, 4]                              text      1/1          0      0    -  -         0.00
view_14                                        view.default                                         f32[2, 8, 16]                                text      1/1          0      0    -  -         0.00
view_15                                        view.default                                         f32[16, 16]                                  text      1/1          0      0    -  -         0.00
t_6                                            t.default                                            f32[16, 16]                                  text      1/1          0      0    -  -         0.00
addmm_5                                        addmm.default                                        f32[16, 16]                                  text      1/1       8192   3136  2.6  memory    2.00
view_16                                        view.default                                         f32[2, 8, 16]                                text      1/1          0      0    -  -         0.00
clone_2                                        clone.default                                        f32[2, 8, 16]                                text      1/1          0   2048  0.0  memory    2.00
add_4                                          add.Tensor                                           f32[2, 8, 16]                                text      1/1        256   3072  0.1  memory    2.00
native_layer_norm_4                            native_layer_norm.default                            (f32[2, 8, 16], f32[2, 8, 1], f32[2, 8, 1])  text      1/1        288   2304  0.1  memory    2.00
getitem_16                                     getitem[0]                                           f32[2, 8, 16]                                text      1/1          0      0    -  -         0.00
getitem_17                                     getitem[1]                                           f32[2, 8, 1]                                 text      1/1          0      0    -  -         0.00
getitem_18                                     getitem[2]                                           f32[2, 8, 1]                                 text      1/1          0      0    -  -         0.00
view_17                                        view.default                                         f32[16, 16]                                  text      1/1          0      0    -  -         0.00
t_7                                            t.default                                            f32[16, 64]                                  text      1/1          0      0    -  -         0.00
addmm_6                                        addmm.default                                        f32[16, 64]                                  text      1/1      32768   9472  3.5  memory    2.00
view_18                                        view.default                                         f32[2, 8, 64]                                text      1/1          0      0    -  -         0.00
gelu_1                                         gelu.default                                         f32[2, 8, 64]                                text      1/1       1024   8192  0.1  memory    2.00
view_19                                        view.default                                         f32[16, 64]                                  text      1/1          0      0    -  -         0.00
t_8                                            t.default                                            f32[64, 16]                                  text      1/1          0      0    -  -         0.00
addmm_7                                        addmm.default                                        f32[16, 16]                                  text      1/1      32768   9280  3.5  memory    2.00
view_20                                        view.default                                         f32[2, 8, 16]                                text      1/1          0      0    -  -         0.00
clone_3                                        clone.default                                        f32[2, 8, 16]                                text      1/1          0   2048  0.0  memory    2.00
add_5                                          add.Tensor                                           f32[2, 8, 16]                                text      1/1        256   3072  0.1  memory    2.00
native_layer_norm_5                            native_layer_norm.default                            (f32[2, 8, 16], f32[2, 8, 1], f32[2, 8, 1])  text      1/1        288   2304  0.1  memory    2.00
getitem_19                                     getitem[0]                                           f32[2, 8, 16]                                text      1/1          0      0    -  -         0.00
getitem_20                                     getitem[1]                                           f32[2, 8, 1]                                 text      1/1          0      0    -  -         0.00
getitem_21                                     getitem[2]                                           f32[2, 8, 1]                                 text      1/1          0      0    -  -         0.00
select_6                                       select.int                                           f32[2, 16]                                   text      1/1          0      0    -  -         0.00
t_9                                            t.default                                            f32[16, 8]                                   text      1/1          0      0    -  -         0.00
mm_1                                           mm.default                                           f32[2, 8]                                    text      1/1        512    704  0.7  memory    2.00
linalg_vector_norm_1                           linalg_vector_norm.default                           f32[2, 1]                                    text      1/1         16     72  0.2  memory    2.00
clamp_min_1                                    clamp_min.default                                    f32[2, 1]                                    text      1/1          2     16  0.1  memory    2.00
expand_1                                       expand.default                                       f32[2, 8]                                    text      1/1          0      0    -  -         0.00
div_1                                          div.Tensor                                           f32[2, 8]                                    text      1/1         16    192  0.1  memory    2.00
exp                                            exp.default                                          f32[]                                        vision    0/0          1      8  0.1  memory    2.00
mul                                            mul.Tensor                                           f32[2, 8]                                    vision    0/0         16    132  0.1  memory    2.00
t_10                                           t.default                                            f32[8, 2]                                    text      1/1          0      0    -  -         0.00
mm_2                                           mm.default                                           f32[2, 2]                                    fusion    0/2         64    144  0.4  memory    2.00
arange                                         arange.default                                       i64[2]                                       fusion    0/2          2     16  0.1  memory    2.00
_log_softmax                                   _log_softmax.default                                 f32[2, 2]                                    fusion    0/2          4     32  0.1  memory    2.00
nll_loss_forward                               nll_loss_forward.default                             (f32[], f32[])                               fusion    0/2          4     40  0.1  memory    2.00
getitem_22                                     getitem[0]                                           f32[]                                        fusion    0/2          0      0    -  -         0.00
getitem_23                                     getitem[1]                                           f32[]                                        fusion    0/2          0      0    -  -         0.00
t_11                                           t.default                                            f32[2, 2]                                    fusion    0/2          0      0    -  -         0.00
_log_softmax_1                                 _log_softmax.default                                 f32[2, 2]                                    fusion    0/2          4     32  0.1  memory    2.00
nll_loss_forward_1                             nll_loss_forward.default                             (f32[], f32[])                               fusion    0/2          4     40  0.1  memory    2.00
getitem_24                                     getitem[0]                                           f32[]                                        fusion    0/2          0      0    -  -         0.00
getitem_25                                     getitem[1]                                           f32[]                                        fusion    0/2          0      0    -  -         0.00
add_6                                          add.Tensor                                           f32[]                                        fusion    0/2          1     12  0.1  memory    2.00
div_2                                          div.Tensor                                           f32[]                                        fusion    0/2          1      8  0.1  memory    2.00
detach_11                                      detach.default                                       f32[2, 4, 8, 4]                              text      1/1          0      0    -  -         0.00
detach_13                                      detach.default                                       f32[2, 4, 4, 4]                              vision    0/0          0      0    -  -         0.00
output                                         output                                               -                                            fusion    -            0      0    -  -         0.00
""")

    def test_backward_listing(self):
        self.assertExpectedInline(self.plan.backward.listing, """\
# apollo frame0_0_backward (backward) planned for H200
node                                                    op                                                            value                                                modality  lane/sg  flops  bytes   AI  bound   est_us  mark
primals_1                                               placeholder                                                   f32[16, 3, 8, 8]                                     vision    -            0      0    -  -         0.00
primals_3                                               placeholder                                                   f32[2, 3, 16, 16]                                    vision    -            0      0    -  -         0.00
primals_5                                               placeholder                                                   f32[16]                                              vision    -            0      0    -  -         0.00
primals_6                                               placeholder                                                   f32[16]                                              vision    -            0      0    -  -         0.00
primals_7                                               placeholder                                                   f32[48, 16]                                          vision    -            0      0    -  -         0.00
primals_9                                               placeholder                                                   f32[16, 16]                                          vision    -            0      0    -  -         0.00
primals_11                                              placeholder                                                   f32[16]                                              vision    -            0      0    -  -         0.00
primals_12                                              placeholder                                                   f32[16]                                              vision    -            0      0    -  -         0.00
primals_13                                              placeholder                                                   f32[64, 16]                                          vision    -            0      0    -  -         0.00
primals_15                                              placeholder                                                   f32[16, 64]                                          vision    -            0      0    -  -         0.00
primals_17                                              placeholder                                                   f32[16]                                              vision    -            0      0    -  -         0.00
primals_18                                              placeholder                                                   f32[16]                                              vision    -            0      0    -  -         0.00
primals_19                                              placeholder                                                   f32[8, 16]                                           vision    -            0      0    -  -         0.00
primals_21                                              placeholder                                                   i64[2, 8]                                            text      -            0      0    -  -         0.00
primals_23                                              placeholder                                                   f32[16]                                              text      -            0      0    -  -         0.00
primals_24                                              placeholder                                                   f32[16]                                              text      -            0      0    -  -         0.00
primals_25                                              placeholder                                                   f32[48, 16]                                          text      -            0      0    -  -         0.00
primals_27                                              placeholder                                                   f32[16, 16]                                          text      -            0      0    -  -         0.00
primals_29                                              placeholder                                                   f32[16]                                              text      -            0      0    -  -         0.00
primals_30                                              placeholder                                                   f32[16]                                              text      -            0      0    -  -         0.00
primals_31                                              placeholder                                                   f32[64, 16]                                          text      -            0      0    -  -         0.00
primals_33                                              placeholder                                                   f32[16, 64]                                          text      -            0      0    -  -         0.00
primals_35                                              placeholder                                                   f32[16]                                              text      -            0      0    -  -         0.00
primals_36                                              placeholder                                                   f32[16]                                              text      -            0      0    -  -         0.00
primals_37                                              placeholder                                                   f32[8, 16]                                           text      -            0      0    -  -         0.00
add                                                     placeholder                                                   f32[2, 4, 16]                                        vision    -            0      0    -  -         0.00
getitem_1                                               placeholder                                                   f32[2, 4, 1]                                         vision    -            0      0    -  -         0.00
getitem_2                                               placeholder                                                   f32[2, 4, 1]                                         vision    -            0      0    -  -         0.00
view_1                                                  placeholder                                                   f32[8, 16]                                           vision    -            0      0    -  -         0.00
select                                                  placeholder                                                   f32[2, 4, 4, 4]                                      vision    -            0      0    -  -         0.00
select_1                                                placeholder                                                   f32[2, 4, 4, 4]                                      vision    -            0      0    -  -         0.00
select_2                                                placeholder                                                   f32[2, 4, 4, 4]                                      vision    -            0      0    -  -         0.00
getitem_4                                               placeholder                                                   f32[2, 4, 4]                                         vision    -            0      0    -  -         0.00
view_5                                                  placeholder                                                   f32[8, 16]                                           vision    -            0      0    -  -         0.00
add_1                                                   placeholder                                                   f32[2, 4, 16]                                        vision    -            0      0    -  -         0.00
getitem_6                                               placeholder                                                   f32[2, 4, 1]                                         vision    -            0      0    -  -         0.00
getitem_7                                               placeholder                                                   f32[2, 4, 1]                                         vision    -            0      0    -  -         0.00
view_7                                                  placeholder                                                   f32[8, 16]                                           vision    -            0      0    -  -         0.00
addmm_2                                                 placeholder                                                   f32[8, 64]                                           vision    -            0      0    -  -         0.00
view_9                                                  placeholder                                                   f32[8, 64]                                           vision    -            0      0    -  -         0.00
add_2                                                   placeholder                                                   f32[2, 4, 16]                                        vision    -            0      0    -  -         0.00
getitem_9                                               placeholder                                                   f32[2, 4, 1]                                         vision    -            0      0    -  -         0.00
getitem_10                                              placeholder                                                   f32[2, 4, 1]                                         vision    -            0      0    -  -         0.00
mean                                                    placeholder                                                   f32[2, 16]                                           vision    -            0      0    -  -         0.00
mm                                                      placeholder                                                   f32[2, 8]                                            vision    -            0      0    -  -         0.00
linalg_vector_norm                                      placeholder                                                   f32[2, 1]                                            vision    -            0      0    -  -         0.00
add_3                                                   placeholder                                                   f32[2, 8, 16]                                        text      -            0      0    -  -         0.00
getitem_12                                              placeholder                                                   f32[2, 8, 1]                                         text      -            0      0    -  -         0.00
getitem_13                                              placeholder                                                   f32[2, 8, 1]                                         text      -            0      0    -  -         0.00
view_11                                                 placeholder                                                   f32[16, 16]                                          text      -            0      0    -  -         0.00
select_3                                                placeholder                                                   f32[2, 4, 8, 4]                                      text      -            0      0    -  -         0.00
select_4                                                placeholder                                                   f32[2, 4, 8, 4]                                      text      -            0      0    -  -         0.00
select_5                                                placeholder                                                   f32[2, 4, 8, 4]                                      text      -            0      0    -  -         0.00
getitem_15                                              placeholder                                                   f32[2, 4, 8]                                         text      -            0      0    -  -         0.00
view_15                                                 placeholder                                                   f32[16, 16]                                          text      -            0      0    -  -         0.00
add_4                                                   placeholder                                                   f32[2, 8, 16]                                        text      -            0      0    -  -         0.00
getitem_17                                              placeholder                                                   f32[2, 8, 1]                                         text      -            0      0    -  -         0.00
getitem_18                                              placeholder                                                   f32[2, 8, 1]                                         text      -            0      0    -  -         0.00
view_17                                                 placeholder                                                   f32[16, 16]                                          text      -            0      0    -  -         0.00
addmm_6                                                 placeholder                                                   f32[16, 64]                                          text      -            0      0    -  -         0.00
view_19                                                 placeholder                                                   f32[16, 64]                                          text      -            0      0    -  -         0.00
add_5                                                   placeholder                                                   f32[2, 8, 16]                                        text      -            0      0    -  -         0.00
getitem_20                                              placeholder                                                   f32[2, 8, 1]                                         text      -            0      0    -  -         0.00
getitem_21                                              placeholder                                                   f32[2, 8, 1]                                         text      -            0      0    -  -         0.00
select_6                                                placeholder                                                   f32[2, 16]                                           text      -            0      0    -  -         0.00
mm_1                                                    placeholder                                                   f32[2, 8]                                            text      -            0      0    -  -         0.00
linalg_vector_norm_1                                    placeholder                                                   f32[2, 1]                                            text      -            0      0    -  -         0.00
div_1                                                   placeholder                                                   f32[2, 8]                                            text      -            0      0    -  -         0.00
exp                                                     placeholder                                                   f32[]                                                vision    -            0      0    -  -         0.00
mul                                                     placeholder                                                   f32[2, 8]                                            vision    -            0      0    -  -         0.00
arange                                                  placeholder                                                   i64[2]                                               fusion    -            0      0    -  -         0.00
_log_softmax                                            placeholder                                                   f32[2, 2]                                            fusion    -            0      0    -  -         0.00
getitem_23                                              placeholder                                                   f32[]                                                fusion    -            0      0    -  -         0.00
_log_softmax_1                                          placeholder                                                   f32[2, 2]                                            fusion    -            0      0    -  -         0.00
getitem_25                                              placeholder                                                   f32[]                                                fusion    -            0      0    -  -         0.00
detach_11                                               placeholder                                                   f32[2, 4, 8, 4]                                      text      -            0      0    -  -         0.00
detach_13                                               placeholder                                                   f32[2, 4, 4, 4]                                      vision    -            0      0    -  -         0.00
tangents_1                                              placeholder                                                   f32[]                                                fusion    -            0      0    -  -         0.00
div_3                                                   div.Tensor                                                    f32[]                                                fusion    0/0          1      8  0.1  memory    2.00
nll_loss_backward                                       nll_loss_backward.default                                     f32[2, 2]                                            fusion    0/0          4     56  0.1  memory    2.00
detach_6                                                detach.default                                                f32[2, 2]                                            fusion*   0/0          0      0    -  -         0.00
detach_7                                                detach.default                                                f32[2, 2]                                            fusion    0/0          0      0    -  -         0.00
_log_softmax_backward_data                              _log_softmax_backward_data.default                            f32[2, 2]                                            fusion    0/0          4     48  0.1  memory    2.00
t_12                                                    t.default                                                     f32[2, 2]                                            fusion    0/0          0      0    -  -         0.00
nll_loss_backward_1                                     nll_loss_backward.default                                     f32[2, 2]                                            fusion    0/0          4     56  0.1  memory    2.00
detach_5                                                detach.default                                                f32[2, 2]                                            fusion*   0/0          0      0    -  -         0.00
detach_8                                                detach.default                                                f32[2, 2]                                            fusion    0/0          0      0    -  -         0.00
_log_softmax_backward_data_1                            _log_softmax_backward_data.default                            f32[2, 2]                                            fusion    0/0          4     48  0.1  memory    2.00
add_7                                                   add.Tensor                                                    f32[2, 2]                                            fusion    0/0          4     48  0.1  memory    2.00
t_13                                                    t.default                                                     f32[2, 2]                                            text      1/1          0      0    -  -         0.00
mm_3                                                    mm.default                                                    f32[2, 8]                                            text      1/1         64    144  0.4  memory    2.00
t_14                                                    t.default                                                     f32[8, 2]                                            text      1/1          0      0    -  -         0.00
t_10                                                    t.default                                                     f32[8, 2]                                            fusion*   0/0          0      0    -  -         0.00
t_15                                                    t.default                                                     f32[2, 8]                                            vision    0/2          0      0    -  -         0.00
mm_4                                                    mm.default                                                    f32[2, 8]                                            vision    0/2         64    144  0.4  memory    2.00
t_16                                                    t.default                                                     f32[2, 8]                                            text      1/1          0      0    -  -         0.00
mul_1                                                   mul.Tensor                                                    f32[2, 8]                                            vision    0/2         16    132  0.1  memory    2.00
clamp_min                                               clamp_min.default                                             f32[2, 1]                                            vision*   0/2          2     16  0.1  memory    2.00
expand                                                  expand.default                                                f32[2, 8]                                            vision*   0/2          0      0    -  -         0.00
div                                                     div.Tensor                                                    f32[2, 8]                                            vision*   0/2         16    192  0.1  memory    2.00
mul_2                                                   mul.Tensor                                                    f32[2, 8]                                            vision    0/2         16    192  0.1  memory    2.00
sum_1                                                   sum.default                                                   f32[]                                                vision    0/2         16     68  0.2  memory    2.00
detach_4                                                detach.default                                                f32[]                                                vision*   0/2          0      0    -  -         0.00
detach_9                                                detach.default                                                f32[]                                                vision    0/2          0      0    -  -         0.00
mul_3                                                   mul.Tensor                                                    f32[]                                                vision    0/2          1     12  0.1  memory    2.00
clamp_min_1                                             clamp_min.default                                             f32[2, 1]                                            text*     1/1          2     16  0.1  memory    2.00
expand_1                                                expand.default                                                f32[2, 8]                                            text*     1/1          0      0    -  -         0.00
div_5                                                   div.Tensor                                                    f32[2, 8]                                            text      1/1         16    192  0.1  memory    2.00
neg                                                     neg.default                                                   f32[2, 8]                                            text      1/1         16    128  0.1  memory    2.00
mul_4                                                   mul.Tensor                                                    f32[2, 8]                                            text      1/1         16    192  0.1  memory    2.00
div_6                                                   div.Tensor                                                    f32[2, 8]                                            text      1/1         16    192  0.1  memory    2.00
sum_2                                                   sum.dim_IntList                                               f32[2, 1]                                            text      1/1         16     72  0.2  memory    2.00
scalar_tensor                                           scalar_tensor.default                                         f32[]                                                fusion    0/0          0      4  0.0  memory    2.00
ge                                                      ge.Scalar                                                     b8[2, 1]                                             text      1/1          2     10  0.2  memory    2.00
where                                                   where.self                                                    f32[2, 1]                                            text      1/1          2     22  0.1  memory    2.00
detach_3                                                detach.default                                                f32[2, 1]                                            text*     1/1          0      0    -  -         0.00
detach_10                                               detach.default                                                f32[2, 1]                                            text      1/1          0      0    -  -         0.00
div_7                                                   div.Tensor                                                    f32[2, 8]                                            text      1/1         16    136  0.1  memory    2.00
eq                                                      eq.Scalar                                                     b8[2, 1]                                             text      1/1          2     10  0.2  memory    2.00
masked_fill                                             masked_fill.Scalar                                            f32[2, 8]                                            text      1/1         16    130  0.1  memory    2.00
mul_5                                                   mul.Tensor                                                    f32[2, 8]                                            text      1/1         16    136  0.1  memory    2.00
add_8                                                   add.Tensor                                                    f32[2, 8]                                            text      1/1         16    192  0.1  memory    2.00
t_17                                                    t.default                                                     f32[8, 2]                                            text      1/1          0      0    -  -         0.00
mm_5                                                    mm.default                                                    f32[8, 16]                                           text      1/1        512    704  0.7  memory    2.00
t_18                                                    t.default                                                     f32[16, 8]                                           text      1/1          0      0    -  -         0.00
t_9                                                     t.default                                                     f32[16, 8]                                           text*     1/1          0      0    -  -         0.00
t_19                                                    t.default                                                     f32[8, 16]                                           text      1/1          0      0    -  -         0.00
mm_6                                                    mm.default                                                    f32[2, 16]                                           text      1/1        512    704  0.7  memory    2.00
t_20                                                    t.default                                                     f32[8, 16]                                           text      1/1          0      0    -  -         0.00
select_backward                                         select_backward.default                                       f32[2, 8, 16]                                        text      1/1          0   1152  0.0  memory    2.00
native_layer_norm_backward                              native_layer_norm_backward.default                            (f32[2, 8, 16], f32[16], f32[16])                    text      1/1        288   3456  0.1  memory    2.00
getitem_26                                              getitem[0]                                                    f32[2, 8, 16]                                        text      1/1          0      0    -  -         0.00
getitem_27                                              getitem[1]                                                    f32[16]                                              text      1/1          0      0    -  -         0.00
getitem_28                                              getitem[2]                                                    f32[16]                                              text      1/1          0      0    -  -         0.00
view_21                                                 view.default                                                  f32[16, 16]                                          text      1/1          0      0    -  -         0.00
t_8                                                     t.default                                                     f32[64, 16]                                          text*     1/1          0      0    -  -         0.00
t_21                                                    t.default                                                     f32[16, 64]                                          text      1/1          0      0    -  -         0.00
mm_7                                                    mm.default                                                    f32[16, 64]                                          text      1/1      32768   9216  3.6  memory    2.00
t_22                                                    t.default                                                     f32[16, 16]                                          text      1/1          0      0    -  -         0.00
mm_8                                                    mm.default                                                    f32[16, 64]                                          text      1/1      32768   9216  3.6  memory    2.00
t_23                                                    t.default                                                     f32[64, 16]                                          text      1/1          0      0    -  -         0.00
sum_3                                                   sum.dim_IntList                                               f32[1, 16]                                           text      1/1        256   1088  0.2  memory    2.00
view_22                                                 view.default                                                  f32[16]                                              text      1/1          0      0    -  -         0.00
t_24                                                    t.default                                                     f32[16, 64]                                          text      1/1          0      0    -  -         0.00
view_23                                                 view.default                                                  f32[2, 8, 64]                                        text      1/1          0      0    -  -         0.00
view_18                                                 view.default                                                  f32[2, 8, 64]                                        text*     1/1          0      0    -  -         0.00
gelu_backward                                           gelu_backward.default                                         f32[2, 8, 64]                                        text      1/1       1024  12288  0.1  memory    2.00
view_24                                                 view.default                                                  f32[16, 64]                                          text      1/1          0      0    -  -         0.00
t_7                                                     t.default                                                     f32[16, 64]                                          text*     1/1          0      0    -  -         0.00
t_25                                                    t.default                                                     f32[64, 16]                                          text      1/1          0      0    -  -         0.00
mm_9                                                    mm.default                                                    f32[16, 16]                                          text      1/1      32768   9216  3.6  memory    2.00
t_26                                                    t.default                                                     f32[64, 16]                                          text      1/1          0      0    -  -         0.00
mm_10                                                   mm.default                                                    f32[64, 16]                                          text      1/1      32768   9216  3.6  memory    2.00
t_27                                                    t.default                                                     f32[16, 64]                                          text      1/1          0      0    -  -         0.00
sum_4                                                   sum.dim_IntList                                               f32[1, 64]                                           text      1/1       1024   4352  0.2  memory    2.00
view_25                                                 view.default                                                  f32[64]                                              text      1/1          0      0    -  -         0.00
t_28                                                    t.default                                                     f32[64, 16]                                          text      1/1          0      0    -  -         0.00
view_26                                                 view.default                                                  f32[2, 8, 16]                                        text      1/1          0      0    -  -         0.00
native_layer_norm_backward_1                            native_layer_norm_backward.default                            (f32[2, 8, 16], f32[16], f32[16])                    text      1/1        288   3456  0.1  memory    2.00
getitem_29                                              getitem[0]                                                    f32[2, 8, 16]                                        text      1/1          0      0    -  -         0.00
getitem_30                                              getitem[1]                                                    f32[16]                                              text      1/1          0      0    -  -         0.00
getitem_31                                              getitem[2]                                                    f32[16]                                              text      1/1          0      0    -  -         0.00
add_9                                                   add.Tensor                                                    f32[2, 8, 16]                                        text      1/1        256   3072  0.1  memory    2.00
view_27                                                 view.default                                                  f32[16, 16]                                          text      1/1          0      0    -  -         0.00
t_6                                                     t.default                                                     f32[16, 16]                                          text*     1/1          0      0    -  -         0.00
t_29                                                    t.default                                                     f32[16, 16]                                          text      1/1          0      0    -  -         0.00
mm_11                                                   mm.default                                                    f32[16, 16]                                          text      1/1       8192   3072  2.7  memory    2.00
t_30                                                    t.default                                                     f32[16, 16]                                          text      1/1          0      0    -  -         0.00
mm_12                                                   mm.default                                                    f32[16, 16]                                          text      1/1       8192   3072  2.7  memory    2.00
t_31                                                    t.default                                                     f32[16, 16]                                          text      1/1          0      0    -  -         0.00
sum_5                                                   sum.dim_IntList                                               f32[1, 16]                                           text      1/1        256   1088  0.2  memory    2.00
view_28                                                 view.default                                                  f32[16]                                              text      1/1          0      0    -  -         0.00
t_32                                                    t.default                                                     f32[16, 16]                                          text      1/1          0      0    -  -         0.00
view_29                                                 view.default                                                  f32[2, 8, 16]                                        text      1/1          0      0    -  -         0.00
view_30                                                 view.default                                                  f32[2, 8, 4, 4]                                      text      1/1          0      0    -  -         0.00
transpose_3                                             transpose.int                                                 f32[2, 4, 8, 4]                                      text      1/1          0      0    -  -         0.00
_scaled_dot_product_flash_attention_for_cpu_backward    _scaled_dot_product_flash_attention_for_cpu_backward.default  (f32[2, 4, 8, 4], f32[2, 4, 8, 4], f32[2, 4, 8, 4])  text      1/1      20480   8448  2.4  memory    2.00
getitem_32                                              getitem[0]                                                    f32[2, 4, 8, 4]                                      text      1/1          0      0    -  -         0.00
getitem_33                                              getitem[1]                                                    f32[2, 4, 8, 4]                                      text      1/1          0      0    -  -         0.00
getitem_34                                              getitem[2]                                                    f32[2, 4, 8, 4]                                      text      1/1          0      0    -  -         0.00
select_backward_1                                       select_backward.default                                       f32[3, 2, 4, 8, 4]                                   text      1/1          0   4096  0.0  memory    2.00
select_backward_2                                       select_backward.default                                       f32[3, 2, 4, 8, 4]                                   text      1/1          0   4096  0.0  memory    2.00
add_10                                                  add.Tensor                                                    f32[3, 2, 4, 8, 4]                                   text      1/1        768   9216  0.1  memory    2.00
select_backward_3                                       select_backward.default                                       f32[3, 2, 4, 8, 4]                                   text      1/1          0   4096  0.0  memory    2.00
add_11                                                  add.Tensor                                                    f32[3, 2, 4, 8, 4]                                   text      1/1        768   9216  0.1  memory    2.00
permute_2                                               permute.default                                               f32[2, 8, 3, 4, 4]                                   text      1/1          0      0    -  -         0.00
clone_4                                                 clone.default                                                 f32[2, 8, 3, 4, 4]                                   text      1/1          0   6144  0.0  memory    2.00
_unsafe_view                                            _unsafe_view.default                                          f32[2, 8, 48]                                        text      1/1          0      0    -  -         0.00
view_31                                                 view.default                                                  f32[16, 48]                                          text      1/1          0      0    -  -         0.00
t_5                                                     t.default                                                     f32[16, 48]                                          text*     1/1          0      0    -  -         0.00
t_33                                                    t.default                                                     f32[48, 16]                                          text      1/1          0      0    -  -         0.00
mm_13                                                   mm.default                                                    f32[16, 16]                                          text      1/1      24576   7168  3.4  memory    2.00
t_34                                                    t.default                                                     f32[48, 16]                                          text      1/1          0      0    -  -         0.00
mm_14                                                   mm.default                                                    f32[48, 16]                                          text      1/1      24576   7168  3.4  memory    2.00
t_35                                                    t.default                                                     f32[16, 48]                                          text      1/1          0      0    -  -         0.00
sum_6                                                   sum.dim_IntList                                               f32[1, 48]                                           text      1/1        768   3264  0.2  memory    2.00
view_32                                                 view.default                                                  f32[48]                                              text      1/1          0      0    -  -         0.00
t_36                                                    t.default                                                     f32[48, 16]                                          text      1/1          0      0    -  -         0.00
view_33                                                 view.default                                                  f32[2, 8, 16]                                        text      1/1          0      0    -  -         0.00
native_layer_norm_backward_2                            native_layer_norm_backward.default                            (f32[2, 8, 16], f32[16], f32[16])                    text      1/1        288   3456  0.1  memory    2.00
getitem_35                                              getitem[0]                                                    f32[2, 8, 16]                                        text      1/1          0      0    -  -         0.00
getitem_36                                              getitem[1]                                                    f32[16]                                              text      1/1          0      0    -  -         0.00
getitem_37                                              getitem[2]                                                    f32[16]                                              text      1/1          0      0    -  -         0.00
add_12                                                  add.Tensor                                                    f32[2, 8, 16]                                        text      1/1        256   3072  0.1  memory    2.00
sum_7                                                   sum.dim_IntList                                               f32[1, 8, 16]                                        text      1/1        256   1536  0.2  memory    2.00
embedding_dense_backward                                embedding_dense_backward.default                              f32[64, 16]                                          text      1/1       1024   5248  0.2  memory    2.00
div_9                                                   div.Tensor                                                    f32[2, 8]                                            vision    0/2         16    192  0.1  memory    2.00
neg_1                                                   neg.default                                                   f32[2, 8]                                            vision    0/2         16    128  0.1  memory    2.00
mul_6                                                   mul.Tensor                                                    f32[2, 8]                                            vision    0/2         16    192  0.1  memory    2.00
div_10                                                  div.Tensor                                                    f32[2, 8]                                            vision    0/2         16    192  0.1  memory    2.00
sum_8                                                   sum.dim_IntList                                               f32[2, 1]                                            vision    0/2         16     72  0.2  memory    2.00
ge_1                                                    ge.Scalar                                                     b8[2, 1]                                             vision    0/2          2     10  0.2  memory    2.00
where_1                                                 where.self                                                    f32[2, 1]                                            vision    0/2          2     22  0.1  memory    2.00
detach_1                                                detach.default                                                f32[2, 1]                                            vision*   0/2          0      0    -  -         0.00
detach_12                                               detach.default                                                f32[2, 1]                                            vision    0/2          0      0    -  -         0.00
div_11                                                  div.Tensor                                                    f32[2, 8]                                            vision    0/2         16    136  0.1  memory    2.00
eq_1                                                    eq.Scalar                                                     b8[2, 1]                                             vision    0/2          2     10  0.2  memory    2.00
masked_fill_1                                           masked_fill.Scalar                                            f32[2, 8]                                            vision    0/2         16    130  0.1  memory    2.00
mul_7                                                   mul.Tensor                                                    f32[2, 8]                                            vision    0/2         16    136  0.1  memory    2.00
add_13                                                  add.Tensor                                                    f32[2, 8]                                            vision    0/2         16    192  0.1  memory    2.00
t_37                                                    t.default                                                     f32[8, 2]                                            vision    0/2          0      0    -  -         0.00
mm_15                                                   mm.default                                                    f32[8, 16]                                           vision    0/2        512    704  0.7  memory    2.00
t_38                                                    t.default                                                     f32[16, 8]                                           vision    0/2          0      0    -  -         0.00
t_4                                                     t.default                                                     f32[16, 8]                                           vision*   0/2          0      0    -  -         0.00
t_39                                                    t.default                                                     f32[8, 16]                                           vision    0/2          0      0    -  -         0.00
mm_16                                                   mm.default                                                    f32[2, 16]                                           vision    0/2        512    704  0.7  memory    2.00
t_40                                                    t.default                                                     f32[8, 16]                                           vision    0/2          0      0    -  -         0.00
unsqueeze                                               unsqueeze.default                                             f32[2, 1, 16]                                        vision    0/2          0      0    -  -         0.00
expand_2                                                expand.default                                                f32[2, 4, 16]                                        vision    0/2          0      0    -  -         0.00
div_12                                                  div.Scalar                                                    f32[2, 4, 16]                                        vision    0/2        128   1024  0.1  memory    2.00
native_layer_norm_backward_3                            native_layer_norm_backward.default                            (f32[2, 4, 16], f32[16], f32[16])                    vision    0/2        160   1856  0.1  memory    2.00
getitem_38                                              getitem[0]                                                    f32[2, 4, 16]                                        vision    0/2          0      0    -  -         0.00
getitem_39                                              getitem[1]                                                    f32[16]                                              vision    0/2          0      0    -  -         0.00
getitem_40                                              getitem[2]                                                    f32[16]                                              vision    0/2          0      0    -  -         0.00
view_34                                                 view.default                                                  f32[8, 16]                                           vision    0/2          0      0    -  -         0.00
t_3                                                     t.default                                                     f32[64, 16]                                          vision*   0/2          0      0    -  -         0.00
t_41                                                    t.default                                                     f32[16, 64]                                          vision    0/2          0      0    -  -         0.00
mm_17                                                   mm.default                                                    f32[8, 64]                                           vision    0/2      16384   6656  2.5  memory    2.00
t_42                                                    t.default                                                     f32[16, 8]                                           vision    0/2          0      0    -  -         0.00
mm_18                                                   mm.default                                                    f32[16, 64]                                          vision    0/2      16384   6656  2.5  memory    2.00
t_43                                                    t.default                                                     f32[64, 16]                                          vision    0/2          0      0    -  -         0.00
sum_9                                                   sum.dim_IntList                                               f32[1, 16]                                           vision    0/2        128    576  0.2  memory    2.00
view_35                                                 view.default                                                  f32[16]                                              vision    0/2          0      0    -  -         0.00
t_44                                                    t.default                                                     f32[16, 64]                                          vision    0/2          0      0    -  -         0.00
view_36                                                 view.default                                                  f32[2, 4, 64]                                        vision    0/2          0      0    -  -         0.00
view_8                                                  view.default                                                  f32[2, 4, 64]                                        vision*   0/2          0      0    -  -         0.00
gelu_backward_1                                         gelu_backward.default                                         f32[2, 4, 64]                                        vision    0/2        512   6144  0.1  memory    2.00
view_37                                                 view.default                                                  f32[8, 64]                                           vision    0/2          0      0    -  -         0.00
t_2                                                     t.default                                                     f32[16, 64]                                          vision*   0/2          0      0    -  -         0.00
t_45                                                    t.default                                                     f32[64, 16]                                          vision    0/2          0      0    -  -         0.00
mm_19                                                   mm.default                                                    f32[8, 16]                                           vision    0/2      16384   6656  2.5  memory    2.00
t_46                                                    t.default                                                     f32[64, 8]                                           vision    0/2          0      0    -  -         0.00
mm_20                                                   mm.default                                                    f32[64, 16]                                          vision    0/2      16384   6656  2.5  memory    2.00
t_47                                                    t.default                                                     f32[16, 64]                                          vision    0/2          0      0    -  -         0.00
sum_10                                                  sum.dim_IntList                                               f32[1, 64]                                           vision    0/2        512   2304  0.2  memory    2.00
view_38                                                 view.default                                                  f32[64]                                              vision    0/2          0      0    -  -         0.00
t_48                                                    t.default                                                     f32[64, 16]                                          vision    0/2          0      0    -  -         0.00
view_39                                                 view.default                                                  f32[2, 4, 16]                                        vision    0/2          0      0    -  -         0.00
native_layer_norm_backward_4                            native_layer_norm_backward.default                            (f32[2, 4, 16], f32[16], f32[16])                    vision    0/2        160   1856  0.1  memory    2.00
getitem_41                                              getitem[0]                                                    f32[2, 4, 16]                                        vision    0/2          0      0    -  -         0.00
getitem_42                                              getitem[1]                                                    f32[16]                                              vision    0/2          0      0    -  -         0.00
getitem_43                                              getitem[2]                                                    f32[16]                                              vision    0/2          0      0    -  -         0.00
add_14                                                  add.Tensor                                                    f32[2, 4, 16]                                        vision    0/2        128   1536  0.1  memory    2.00
view_40                                                 view.default                                                  f32[8, 16]                                           vision    0/2          0      0    -  -         0.00
t_1                                                     t.default                                                     f32[16, 16]                                          vision*   0/2          0      0    -  -         0.00
t_49                                                    t.default                                                     f32[16, 16]                                          vision    0/2          0      0    -  -         0.00
mm_21                                                   mm.default                                                    f32[8, 16]                                           vision    0/2       4096   2048  2.0  memory    2.00
t_50                                                    t.default                                                     f32[16, 8]                                           vision    0/2          0      0    -  -         0.00
mm_22                                                   mm.default                                                    f32[16, 16]                                          vision    0/2       4096   2048  2.0  memory    2.00
t_51                                                    t.default                                                     f32[16, 16]                                          vision    0/2          0      0    -  -         0.00
sum_11                                                  sum.dim_IntList                                               f32[1, 16]                                           vision    0/2        128    576  0.2  memory    2.00
view_41                                                 view.default                                                  f32[16]                                              vision    0/2          0      0    -  -         0.00
t_52                                                    t.default                                                     f32[16, 16]                                          vision    0/2          0      0    -  -         0.00
view_42                                                 view.default                                                  f32[2, 4, 16]                                        vision    0/2          0      0    -  -         0.00
view_43                                                 view.default                                                  f32[2, 4, 4, 4]                                      vision    0/2          0      0    -  -         0.00
transpose_4                                             transpose.int                                                 f32[2, 4, 4, 4]                                      vision    0/2          0      0    -  -         0.00
_scaled_dot_product_flash_attention_for_cpu_backward_1  _scaled_dot_product_flash_attention_for_cpu_backward.default  (f32[2, 4, 4, 4], f32[2, 4, 4, 4], f32[2, 4, 4, 4])  vision    0/2       5120   4224  1.2  memory    2.00
getitem_44                                              getitem[0]                                                    f32[2, 4, 4, 4]                                      vision    0/2          0      0    -  -         0.00
getitem_45                                              getitem[1]                                                    f32[2, 4, 4, 4]                                      vision    0/2          0      0    -  -         0.00
getitem_46                                              getitem[2]                                                    f32[2, 4, 4, 4]                                      vision    0/2          0      0    -  -         0.00
select_backward_4                                       select_backward.default                                       f32[3, 2, 4, 4, 4]                                   vision    0/2          0   2048  0.0  memory    2.00
select_backward_5                                       select_backward.default                                       f32[3, 2, 4, 4, 4]                                   vision    0/2          0   2048  0.0  memory    2.00
add_15                                                  add.Tensor                                                    f32[3, 2, 4, 4, 4]                                   vision    0/2        384   4608  0.1  memory    2.00
select_backward_6                                       select_backward.default                                       f32[3, 2, 4, 4, 4]                                   vision    0/2          0   2048  0.0  memory    2.00
add_16                                                  add.Tensor                                                    f32[3, 2, 4, 4, 4]                                   vision    0/2        384   4608  0.1  memory    2.00
permute_3                                               permute.default                                               f32[2, 4, 3, 4, 4]                                   vision    0/2          0      0    -  -         0.00
clone_5                                                 clone.default                                                 f32[2, 4, 3, 4, 4]                                   vision    0/2          0   3072  0.0  memory    2.00
_unsafe_view_1                                          _unsafe_view.default                                          f32[2, 4, 48]                                        vision    0/2          0      0    -  -         0.00
view_44                                                 view.default                                                  f32[8, 48]                                           vision    0/2          0      0    -  -         0.00
t                                                       t.default                                                     f32[16, 48]                                          vision*   0/2          0      0    -  -         0.00
t_53                                                    t.default                                                     f32[48, 16]                                          vision    0/2          0      0    -  -         0.00
mm_23                                                   mm.default                                                    f32[8, 16]                                           vision    0/2      12288   5120  2.4  memory    2.00
t_54                                                    t.default                                                     f32[48, 8]                                           vision    0/2          0      0    -  -         0.00
mm_24                                                   mm.default                                                    f32[48, 16]                                          vision    0/2      12288   5120  2.4  memory    2.00
t_55                                                    t.default                                                     f32[16, 48]                                          vision    0/2          0      0    -  -         0.00
sum_12                                                  sum.dim_IntList                                               f32[1, 48]                                           vision    0/2        384   1728  0.2  memory    2.00
view_45                                                 view.default                                                  f32[48]                                              vision    0/2          0      0    -  -         0.00
t_56                                                    t.default                                                     f32[48, 16]                                          vision    0/2          0      0    -  -         0.00
view_46                                                 view.default                                                  f32[2, 4, 16]                                        vision    0/2          0      0    -  -         0.00
native_layer_norm_backward_5                            native_layer_norm_backward.default                            (f32[2, 4, 16], f32[16], f32[16])                    vision    0/2        160   1856  0.1  memory    2.00
getitem_47                                              getitem[0]                                                    f32[2, 4, 16]                                        vision    0/2          0      0    -  -         0.00
getitem_48                                              getitem[1]                                                    f32[16]                                              vision    0/2          0      0    -  -         0.00
getitem_49                                              getitem[2]                                                    f32[16]                                              vision    0/2          0      0    -  -         0.00
add_17                                                  add.Tensor                                                    f32[2, 4, 16]                                        vision    0/2        128   1536  0.1  memory    2.00
sum_13                                                  sum.dim_IntList                                               f32[1, 4, 16]                                        vision    0/2        128    768  0.2  memory    2.00
transpose_5                                             transpose.int                                                 f32[2, 16, 4]                                        vision    0/2          0      0    -  -         0.00
view_47                                                 view.default                                                  f32[2, 16, 2, 2]                                     vision    0/2          0      0    -  -         0.00
convolution_backward                                    convolution_backward.default                                  (-, f32[16, 3, 8, 8], f32[16])                       vision    0/2      49152  31296  1.6  memory    2.01
getitem_51                                              getitem[1]                                                    f32[16, 3, 8, 8]                                     vision    0/2          0      0    -  -         0.00
getitem_52                                              getitem[2]                                                    f32[16]                                              vision    0/2          0      0    -  -         0.00
output                                                  output                                                        -                                                    fusion    -            0      0    -  -         0.00
""")

    def test_forward_runtime(self):
        self.assertExpectedInline(self.plan.forward.runtime_source, """\
# apollo_compile runtime for frame0_0_forward
# Constructed by apollo_compile.passes.codegen: 3 subgraph(s) on 2 lane(s), 1 cross-lane wait(s).
#   lane 0: main stream [fusion, vision]
#   lane 1: side stream [text]
# Names are the FX node names of the frame0_0_forward graph; subgraph_<i> is subgraph i compiled.

def run(args):
    (
        primals_1, primals_2, primals_3, primals_4, primals_5, primals_6, primals_7, primals_8,
        primals_9, primals_10, primals_11, primals_12, primals_13, primals_14, primals_15,
        primals_16, primals_17, primals_18, primals_19, primals_20, primals_21, primals_22,
        primals_23, primals_24, primals_25, primals_26, primals_27, primals_28, primals_29,
        primals_30, primals_31, primals_32, primals_33, primals_34, primals_35, primals_36,
        primals_37, primals_38
    ) = args
    args.clear()
    rt.fork([1])  # side lanes start after the caller's pending work
    with rt.lane(1):
        rt.keep_alive(1,
            primals_20, primals_21, primals_22, primals_23, primals_24, primals_25, primals_26,
            primals_27, primals_28, primals_29, primals_30, primals_31, primals_32, primals_33,
            primals_34, primals_35, primals_36, primals_37
        )
        # subgraph 1: text | 55 nodes | est 38.0 us
        inputs_1 = [
            primals_20, primals_21, primals_22, primals_23, primals_24, primals_25, primals_26,
            primals_27, primals_28, primals_29, primals_30, primals_31, primals_32, primals_33,
            primals_34, primals_35, primals_36, primals_37
        ]
        del (primals_20, primals_22, primals_26, primals_28, primals_32, primals_34)
        (
            add_3, getitem_12, getitem_13, view_11, select_3, select_4, select_5, getitem_15, view_15,
            add_4, getitem_17, getitem_18, view_17, addmm_6, view_19, add_5, getitem_20, getitem_21,
            select_6, mm_1, linalg_vector_norm_1, div_1, t_10, detach_11
        ) = subgraph_1(inputs_1)
        rt.record(1)
    # subgraph 0: vision | 58 nodes | est 44.0 us
    inputs_0 = [
        primals_3, primals_1, primals_2, primals_4, primals_5, primals_6, primals_7, primals_8,
        primals_9, primals_10, primals_11, primals_12, primals_13, primals_14, primals_15,
        primals_16, primals_17, primals_18, primals_19, primals_38
    ]
    del (primals_2, primals_4, primals_8, primals_10, primals_14, primals_16, primals_38)
    (
        add, getitem_1, getitem_2, view_1, select, select_1, select_2, getitem_4, view_5, add_1,
        getitem_6, getitem_7, view_7, addmm_2, view_9, add_2, getitem_9, getitem_10, mean, mm,
        linalg_vector_norm, exp, mul, detach_13
    ) = subgraph_0(inputs_0)
    rt.wait(1)  # needs subgraph 1 (lane 1)
    rt.keep_alive(0, t_10)
    # subgraph 2: fusion | 13 nodes | est 16.0 us
    inputs_2 = [mul, t_10]
    del (t_10)
    (arange, _log_softmax, getitem_23, _log_softmax_1, getitem_25, div_2) = subgraph_2(inputs_2)
    rt.release()  # every lane has joined: values read across lanes may be freed
    return (
        div_2, primals_1, primals_3, primals_5, primals_6, primals_7, primals_9, primals_11,
        primals_12, primals_13, primals_15, primals_17, primals_18, primals_19, primals_21,
        primals_23, primals_24, primals_25, primals_27, primals_29, primals_30, primals_31,
        primals_33, primals_35, primals_36, primals_37, add, getitem_1, getitem_2, view_1, select,
        select_1, select_2, getitem_4, view_5, add_1, getitem_6, getitem_7, view_7, addmm_2, view_9,
        add_2, getitem_9, getitem_10, mean, mm, linalg_vector_norm, add_3, getitem_12, getitem_13,
        view_11, select_3, select_4, select_5, getitem_15, view_15, add_4, getitem_17, getitem_18,
        view_17, addmm_6, view_19, add_5, getitem_20, getitem_21, select_6, mm_1,
        linalg_vector_norm_1, div_1, exp, mul, arange, _log_softmax, getitem_23, _log_softmax_1,
        getitem_25, detach_11, detach_13
    )
""")


class TestGoldenOffload(TestCase):
    """The offload pass's marks: every value the forward sends to the host comes back in the
    backward (offload_activations, every value offloaded whatever its size). The vision tower's
    saved block output is not among them: it is non-contiguous, which PyTorch does not offload."""

    def setUp(self):
        from apollo_compile.passes import offload

        torch._dynamo.reset()
        self.min_bytes, offload.MIN_BYTES = offload.MIN_BYTES, 0
        torch.manual_seed(0)
        model = TwoTower(width=16, embed=8, layers=1)
        compiled = torch.compile(model, backend="apollo", options={
            "subgraph_compiler": "eager", "device": "H200", "offload_activations": True, "memory_budget": 0.3})
        compiled(*two_tower_inputs(batch=2)).backward()
        self.plan = apollo_compile.last_plan()

    def tearDown(self):
        from apollo_compile.passes import offload

        offload.MIN_BYTES = self.min_bytes

    def marked(self, graph) -> str:
        """node, op, value and mark of each listed copy (the listing's other columns are pinned above)."""
        rows = [r for r in dump.rows(graph.gm) if r["transfer"]]
        return "".join(f"{r['node']} {r['op']} {r['value']} {r['modality']} -> {r['transfer']}\n" for r in rows)

    def test_copies_to_the_host_and_back(self):
        self.assertExpectedInline(self.marked(self.plan.forward), """\
cpu_offload_add_4 prims.device_put.default f32[2, 8, 16] text -> to host
cpu_offload_add_5 prims.device_put.default f32[2, 8, 16] text -> to host
""")
        self.assertExpectedInline(self.marked(self.plan.backward), """\
gpu_reload_add_5 prims.device_put.default f32[2, 8, 16] text -> to device
gpu_reload_add_4 prims.device_put.default f32[2, 8, 16] text -> to device
""")
