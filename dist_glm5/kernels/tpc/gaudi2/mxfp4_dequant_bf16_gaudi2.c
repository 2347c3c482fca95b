/* MXFP4 -> bf16 dequantisation of packed expert rows, for Gaudi 2 (TPC-C).
 *
 * Written for this project against the documented intrinsics (Habana_Custom_Kernel
 * doc/tpc-intrinsics.h); NEVER COMPILED HERE (no tpc-clang on our machines). Its per-lane
 * arithmetic is modelled bit for bit on the CPU by tests/test_hpu_tpc.py (`tpc_model`), which
 * checks it against dist_glm5.quant.mxfp4.decode on all 256 scale bytes and all 16 codes.
 *
 * Inputs (the served layout, read as it is):
 *   packed  u8 [R, K/2]   two E2M1 codes per byte, element 2j in the LOW nibble
 *   scales  u8 [R, K/32]  one E8M0 byte per 32 consecutive elements, value 2^(byte-127)
 * Output:
 *   out     bf16 [R, K]   COLUMNS PERMUTED within each 512-element block (no cross-lane moves):
 *                         position p holds element e = 8*i + 2*b + h, where q = p/2, h = p%2,
 *                         b = q/64, i = q%64. The consumer multiplies x[:, perm] by it
 *                         (dist_glm5/backends/hpu/custom_ops.py `input_permutation`): a GEMM
 *                         over a permuted input dimension is the same GEMM.
 * K must be a multiple of 512 (GLM-5: H = 6144, I = 2048).
 *
 * Lane work: one u32 lane holds 4 packed bytes = 8 elements of one 32-element block, so a
 * lane's scale is one byte; byte b of lane i gives one u32 of output, two bf16 bit patterns built
 * with integer ops only (exact: E2M1 x 2^k has at most 2 significant bits):
 *   m = code & 7, ec = m >> 1, bp = s + ec       (bp = biased bf16 exponent + 1)
 *   mantissa bit = m & 1 for m >= 2 (1.5, 3, 6); code 1 (0.5) has none
 *   bp >= 2:  normal,    (bp - 1) << 7 | mant << 6
 *   bp <= 1:  subnormal, (2 + mant) << (bp + 4)  (byte 0 is 2^-127: a subnormal scale, kept)
 *   bp >= 256: inf; m == 0: zero; the sign is bit 3 of the code; scale byte 0xFF: NaN (0x7FC0).
 */

static uint64 bf16_bits(uint64 code, uint64 s)
{
    uint64 sign = v_u32_shl_b(v_u32_and_b(code, 8), 12);
    uint64 m = v_u32_and_b(code, 7);
    uint64 ec = v_u32_shr_b(m, 1);
    uint64 bp = v_u32_add_b(s, ec);
    uint64 mant = v_u32_sel_geq_u32_b(m, 2, v_u32_and_b(m, 1), 0);
    uint64 normal = v_u32_or_b(v_u32_shl_b(v_u32_sub_b(bp, 1), 7), v_u32_shl_b(mant, 6));
    uint64 subnormal = v_u32_shl_b(v_u32_add_b(mant, 2), (int64)v_u32_add_b(bp, 4));
    uint64 mag = v_u32_sel_less_u32_b(bp, 2, subnormal, normal);
    mag = v_u32_sel_geq_u32_b(bp, 256, 0x7F80, mag);
    mag = v_u32_sel_eq_u32_b(m, 0, 0, mag);
    return v_u32_sel_eq_u32_b(s, 255, 0x7FC0, v_u32_or_b(sign, mag));
}

void main(tensor packed, tensor scales, tensor out)
{
    const int5 start = get_index_space_offset();
    const int5 end = get_index_space_size() + start;
    int5 in_c = {0, 0, 0, 0, 0};
    int5 sc_c = {0, 0, 0, 0, 0};
    int5 out_c = {0, 0, 0, 0, 0};
    /* lanes 4g..4g+3 cover the 32 elements of scale byte g (of 16 per vector) */
    const uint64 group = v_u32_shr_b(read_lane_id_4b_b(), 2);

    for (int r = start[1]; r < end[1]; r++) {
        in_c[1] = r;
        sc_c[1] = r;
        out_c[1] = r;
        for (int v = start[0]; v < end[0]; v++) {
            in_c[0] = v * 256;                      /* bytes: 256 packed bytes per vector */
            uint64 w = v_u32_ld_tnsr_b(in_c, packed);
            uint64 s = 0;
            for (int g = 0; g < 16; g++) {          /* the 16 scale bytes, broadcast by group */
                sc_c[0] = v * 16 + g;
                __global void *a = gen_addr(sc_c, scales);
                uint32_t sg = s_u8_ld_g(a);
                s = v_u32_sel_eq_u32_b(group, g, sg, s);
            }
            for (int b = 0; b < 4; b++) {
                uint64 byte = v_u32_and_b(v_u32_shr_b(w, 8 * b), 0xFF);
                uint64 lo = bf16_bits(v_u32_and_b(byte, 0xF), s);
                uint64 hi = bf16_bits(v_u32_shr_b(byte, 4), s);
                out_c[0] = v * 512 + b * 128;       /* bf16 elements: 64 u32 = 128 bf16 */
                v_u32_st_tnsr(out_c, out, v_u32_or_b(lo, v_u32_shl_b(hi, 16)));
            }
        }
    }
}
