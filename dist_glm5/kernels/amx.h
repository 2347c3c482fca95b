/* Intel AMX tiles, shared by the kernels that use them (dsa_select.c: int8 keys; gemv_tiles.h and
 * mxfp4_moe.c: bf16 products): whether this build and process may use them, the configuration's
 * layout, and the bf16 products' configuration. dist_glm5/kernels/build.py hashes it with each
 * source that includes it. */
#ifndef DIST_GLM5_AMX_H
#define DIST_GLM5_AMX_H
#include <stdint.h>
#include <string.h>

/* Built with AMX only by gcc >= 12 on x86-64 (the tile intrinsics); elsewhere HAVE_AMX is 0 and
 * every kernel keeps its other paths. */
#if defined(__GNUC__) && __GNUC__ >= 12 && defined(__x86_64__)
#define HAVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define AMX_BF16_T __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512vbmi,avx512bf16,avx2,fma")))
#else
#define HAVE_AMX 0
#endif

typedef struct { /* ldtilecfg's 64 bytes, palette 1 */
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tilecfg;

/* Whether the CPU has the tiles and Linux lets this process use them (arch_prctl
 * ARCH_REQ_XCOMP_PERM, asked once a library); callers check amx-int8 or amx-bf16 themselves. */
static __attribute__((unused)) int amx_granted(void) {
    static int granted = -1;
#if HAVE_AMX
    if (granted < 0)
        granted = __builtin_cpu_supports("amx-tile") &&
                  syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                          18 /* XFEATURE_XTILEDATA */) == 0;
#else
    granted = 0;
#endif
    return granted;
}

/* The int8 or bf16 tiles: the CPU has them and Linux grants them (__builtin_cpu_supports takes
 * a literal, hence the branch). */
enum amx_kind { AMX_INT8, AMX_BF16 };

static __attribute__((unused)) int amx_here(enum amx_kind kind) {
#if HAVE_AMX
    const int has = kind == AMX_BF16 ? __builtin_cpu_supports("amx-bf16")
                                     : __builtin_cpu_supports("amx-int8");
    return has && amx_granted();
#else
    (void)kind;
    return 0;
#endif
}

/* n rows (bf16, K inputs each; row t at rows[t]) -> B's layout at dst: per 16 rows c (mt of
 * them), at dst + c * K, per block of 32 inputs a 16 x mt array of dwords whose row i holds
 * inputs 2i and 2i + 1 of each row. dst has the rows' size. */
static __attribute__((unused)) void amx_pack_rows(const uint16_t *const *rows, int n, int K,
                                                  uint16_t *dst) {
    for (int c = 0; c < n; c += 16) {
        const int mt = n - c < 16 ? n - c : 16;
        uint32_t *d = (uint32_t *)(dst + (int64_t)c * K);
        for (int t = 0; t < mt; t++) {
            const uint32_t *src = (const uint32_t *)rows[c + t];
            for (int b = 0; b < K / 32; b++)
                for (int i = 0; i < 16; i++) d[(int64_t)b * 16 * mt + i * mt + t] = src[b * 16 + i];
        }
    }
}

#if HAVE_AMX
/* The bf16 products' tiles (tdpbf16ps): tmm0, tmm1: C, ar rows x m0 and m1 x rows or tokens of
 * fp32; tmm2, tmm3: A, ar rows x 32 bf16; tmm4, tmm5: B, 16 dword pairs x m0 and m1 columns.
 * The tile state is the thread's and anyone's (oneDNN's AMX GEMMs run on these threads too): a
 * parallel region starts with *key = -1, this loads a configuration only when the shapes change
 * (a load and a release per call cost 1.2 ms of a 13 ms batch-1 step), and the region ends with
 * amx_bf16_release() where the key is no longer -1. */
static __attribute__((unused)) AMX_BF16_T void amx_bf16_shape(int ar, int m0, int m1, int *key) {
    const int k = ar | m0 << 5 | m1 << 10;
    if (k == *key) return;
    amx_tilecfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    c.rows[0] = (uint8_t)ar, c.colsb[0] = (uint16_t)(4 * m0);
    c.rows[2] = c.rows[3] = (uint8_t)ar, c.colsb[2] = c.colsb[3] = 64;
    c.rows[4] = 16, c.colsb[4] = (uint16_t)(4 * m0);
    if (m1) {
        c.rows[1] = (uint8_t)ar, c.colsb[1] = (uint16_t)(4 * m1);
        c.rows[5] = 16, c.colsb[5] = (uint16_t)(4 * m1);
    }
    _tile_loadconfig(&c);
    *key = k;
}

static __attribute__((unused)) AMX_BF16_T void amx_bf16_release(void) { _tile_release(); }

/* One block of 32 inputs: C0 (+ C1) += A tile `a` (2 or 3: a constant) times block b's B tiles of
 * the packed rows at b0 (m0 of them) and b1 (m1, 0: none). */
#define AMX_BF16_BLOCK(a, b0, b1, b, m0, m1)                                                    \
    do {                                                                                        \
        _tile_loadd(4, (b0) + (int64_t)(b) * 32 * (m0), 4 * (m0));                              \
        _tile_dpbf16ps(0, a, 4);                                                                \
        if (m1) {                                                                               \
            _tile_loadd(5, (b1) + (int64_t)(b) * 32 * (m1), 4 * (m1));                          \
            _tile_dpbf16ps(1, a, 5);                                                            \
        }                                                                                       \
    } while (0)

/* C0 and C1 (when m1) to c[0], c[1]: row j, column t at c[h][j * m + t] */
#define AMX_BF16_STORE(c, m0, m1)                                                               \
    do {                                                                                        \
        _tile_stored(0, (c)[0], 4 * (m0));                                                      \
        if (m1) _tile_stored(1, (c)[1], 4 * (m1));                                              \
    } while (0)

#endif
#endif
