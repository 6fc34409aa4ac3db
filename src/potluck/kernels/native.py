"""Kernels in C (AVX-512 VNNI) for decoding and prompt micro-batches, built once per machine with its C compiler.

Why: at batch 1 torch has no kernel that reads GGML-style group-quantized weights at memory speed
(its packed int4 matmul covers 4-bit types only; the rest ran as dense bf16, twice Q8_0's bytes),
and each small torch op costs ≈ 2 µs of dispatch, ≈ 25 ops per layer. One core, medians:
Gemma-3's 262144 x 640 Q8_0 head 28 ms as bf16, 7.3 ms here; SmolLM2's q/k/v 960 x 576 Q4_1
27 µs here against ≈ 45 µs as three torch int4 calls.

  Gemv            y = x @ W.T for a weight held as 4-bit (u4, groups of 32) or 8-bit (u8, groups
                  of 16 or 32) values u with a scale and an optional min per group:
                  w = scale * (u - offset) + min (`Format`), in tiles of TILE_ROWS rows (`pack`).
                  Each group of activations becomes 15-bit fixed point (error <= max|x_group| /
                  32766 per value; bf16: |x| / 512); VNNI byte dot products sum exactly in int32;
                  scales, mins and the result are fp32.
  Gemv.batched    the same product for prompt micro-batches (9+ rows): activations as int8 per
                  group (amax / 127, as llama.cpp's q8_0), one VNNI dot product per 64 weight
                  bytes and row, a weight tile unpacked once for 8 rows; the same arithmetic
                  per row whatever the batch.
  rms_norm        RMSNorm, optionally of x + residual.
  gated           act(gate) * up (SiLU or GELU-tanh).
  DecodeAttention one decoded token's q/k norms, RoPE, KV-cache write and attention.

`library()` compiles the source below on first use into the potluck cache (≈ 1 s; keyed by the
source, the flags and the CPU's feature flags) and returns None where that is not possible (no C
compiler, no AVX-512 VNNI, not x86-64; `unavailable_reason()` says which): callers then use
torch's kernels.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import hashlib
import mmap
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from potluck.modelfile.sources import cache_dir

TILE_ROWS = 4  # weight rows interleaved per tile (ROWS in the C source)
CHUNK_BYTES = 64  # weight bytes per row per step: one AVX-512 register
U4_GROUP = 32
MAX_HEAD_DIM = 512  # MAX_HD in the C source

_SOURCE = r"""
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VNNI__)
#error "these kernels need AVX-512 F/BW and VNNI"
#endif

#define XMAX 16383.0f  /* activations become 15-bit fixed point: |X| <= XMAX */
/* Weight rows per tile. A tile's rows share the activation loads and are interleaved chunk by
 * chunk in memory, so that it streams in order (rows apart: the 262144 x 640 head took 18-19 ms
 * instead of 7-8). */
#define ROWS 4
/* Work (weights times rows) below which a kernel runs on one thread, like torch's grain size:
 * waking a second thread costs µs, far more on a busy machine where it may not get a core. */
#define PAR_MIN 262144
/* Bytes prefetched ahead of the tile being read: without, 30 cold 3072 x 576 Q4_1 weights take
 * 78 instead of 65 µs each, 4096 x 640 u8 156 instead of 131 (2048-8192 measured alike). */
#define PF 4096

/* A row walks its weights in 64-byte chunks. u4: a chunk is 4 groups of 32 (128 weights; the two
 * nibbles of a byte land in the same int32 lane); u8: 4 groups of 16 or 2 of 32 (64 weights).
 * LPG int32 lanes (4 bytes each) belong to one group: 4, or 8 for u8 with G = 32. The last chunk
 * of a row may be short (16-48 bytes, e.g. SmolLM2's n_in = 576: 288 bytes per u4 row): a tile
 * holds its full chunks, [n_full][ROWS][64] bytes, then the short ones, [ROWS][tail]. */
static int n_chunks(int K, int u4) { return u4 ? (K + 127) / 128 : (K + 63) / 64; }
static int row_bytes(int K, int u4) { return u4 ? K / 2 : K; }
static int lanes_per_group(int G, int u4) { return (u4 || G == 16) ? 4 : 8; }

/* One row of activations laid out like the weight chunks. Per chunk c: xh, xl: X = 128 xh + xl at
 * the byte of the weight it multiplies (u4: 128 bytes, low-nibble half then high-nibble half);
 * sx: the group scale in each of its lanes; corr: offset * sum(X) of each group in its first lane
 * (removes the weights' +8 / +128 exactly, in int32). xsum: exact fp32 sum of x per group. */
typedef struct {
    int8_t *xh, *xl;
    float *sx;
    int32_t *corr;
    float *xsum;
} Acts;

static void prepare(const float *x, int K, int G, int u4, int off, Acts *a) {
    const int ng = K / G, nc = n_chunks(K, u4), cb = u4 ? 128 : 64;
    const int lpg = lanes_per_group(G, u4), gpc = 16 / lpg;
    memset(a->xh, 0, (size_t)nc * cb);
    memset(a->xl, 0, (size_t)nc * cb);
    memset(a->sx, 0, (size_t)nc * 16 * sizeof(float));
    memset(a->corr, 0, (size_t)nc * 16 * sizeof(int32_t));
    const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
    for (int g = 0; g < ng; g++) {
        /* the group as 1 or 2 vectors of 16 (G = 16 or 32) */
        const __m512 v0 = _mm512_loadu_ps(x + (size_t)g * G);
        const __m512 v1 = G == 32 ? _mm512_loadu_ps(x + (size_t)g * G + 16) : _mm512_setzero_ps();
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(v0, sign), _mm512_and_ps(v1, sign)));
        a->xsum[g] = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
        const __m512 inv = _mm512_set1_ps(amax > 0.0f ? XMAX / amax : 0.0f);
        const __m512i X0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)); /* round to nearest even */
        const __m512i X1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
        const int c = g / gpc, lane0 = (g % gpc) * lpg;
        /* byte positions of values 0-15 and 16-31: u4 puts them in the chunk's two halves */
        const size_t p0 = u4 ? (size_t)c * 128 + (g % 4) * 16 : (size_t)g * G, p1 = u4 ? p0 + 64 : p0 + 16;
        const __m512i m127 = _mm512_set1_epi32(127);
        _mm_storeu_si128((__m128i *)(a->xh + p0), _mm512_cvtepi32_epi8(_mm512_srai_epi32(X0, 7)));
        _mm_storeu_si128((__m128i *)(a->xl + p0), _mm512_cvtepi32_epi8(_mm512_and_si512(X0, m127)));
        if (G == 32) {
            _mm_storeu_si128((__m128i *)(a->xh + p1), _mm512_cvtepi32_epi8(_mm512_srai_epi32(X1, 7)));
            _mm_storeu_si128((__m128i *)(a->xl + p1), _mm512_cvtepi32_epi8(_mm512_and_si512(X1, m127)));
        }
        for (int l = 0; l < lpg; l++) a->sx[c * 16 + lane0 + l] = amax / XMAX;
        a->corr[c * 16 + lane0] = off * _mm512_reduce_add_epi32(_mm512_add_epi32(X0, X1));
    }
}

/* 16 scales or mins from fp16 (half) or fp32 storage, masked */
static inline __m512 load16(const void *p, size_t i, __mmask16 k, int half) {
    return half ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, (const uint16_t *)p + i))
                : _mm512_maskz_loadu_ps(k, (const float *)p + i);
}

/* sum of mn[i] * xsum[i], i < n; mn fp16 (half) or fp32 */
static float min_term(const void *mn, const float *xsum, int n, int half) {
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) {
        const __mmask16 k = n - i >= 16 ? 0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        acc = _mm512_fmadd_ps(load16(mn, i, k, half), _mm512_maskz_loadu_ps(k, xsum + i), acc);
    }
    return _mm512_reduce_add_ps(acc);
}

/* One tile (ROWS weight rows) against one row of activations; writes y[n0 .. n0 + n_valid). */
static inline __attribute__((always_inline)) void tile(
    const uint8_t *qt, const void *st, const void *mn, const Acts *a, float *y,
    int n0, int n_valid, int K, int G, int u4, int half, int has_off) {
    const int nc = n_chunks(K, u4), ng = K / G;
    const int lpg = lanes_per_group(G, u4), gpc = 16 / lpg;
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512i idx[ROWS];
    __m512 acc[ROWS];
    for (int r = 0; r < ROWS; r++) {
        /* lane l of row r takes scale r * gpc + l / lpg of the chunk's [ROWS, gpc] scales */
        idx[r] = _mm512_add_epi32(_mm512_set1_epi32(r * gpc),
                                  _mm512_srli_epi32(lane, lpg == 4 ? 2 : 3));
        acc[r] = _mm512_setzero_ps();
    }
    const int tail = row_bytes(K, u4) % 64, n_full = row_bytes(K, u4) / 64;
    for (int c = 0; c < nc; c++) {
        /* a short last chunk: its rows are `tail` bytes apart, read with a byte mask */
        const int step = c < n_full ? 64 : tail;
        const __mmask64 kb = c < n_full ? ~0ULL : (1ULL << tail) - 1;
        const uint8_t *q = qt + (size_t)c * ROWS * 64;
        for (int r = 0; r < ROWS; r++) _mm_prefetch((const char *)(q + PF + 64 * r), _MM_HINT_T0);
        const __m512 s = load16(st, (size_t)c * ROWS * gpc, gpc * ROWS == 16 ? 0xFFFF : 0xFF, half);
        const __m512i corr = _mm512_load_si512(a->corr + 16 * c);
        const __m512 sx = _mm512_load_ps(a->sx + 16 * c);
        if (u4) {
            const __m512i xlh = _mm512_load_si512(a->xh + 128 * c), xhh = _mm512_load_si512(a->xh + 128 * c + 64);
            const __m512i xll = _mm512_load_si512(a->xl + 128 * c), xhl = _mm512_load_si512(a->xl + 128 * c + 64);
            for (int r = 0; r < ROWS; r++) {
                const __m512i v = _mm512_maskz_loadu_epi8(kb, q + step * r);
                const __m512i lo = _mm512_and_si512(v, m4);
                const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                __m512i h = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xlh);
                __m512i l = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xll);
                h = _mm512_dpbusd_epi32(h, hi, xhh);
                l = _mm512_dpbusd_epi32(l, hi, xhl);
                __m512i t = _mm512_add_epi32(_mm512_slli_epi32(h, 7), l);
                if (has_off) t = _mm512_sub_epi32(t, corr); /* Q4_1 has none: -5 % time */
                const __m512 sr = _mm512_mul_ps(_mm512_permutexvar_ps(idx[r], s), sx);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), sr, acc[r]);
            }
        } else {
            const __m512i xh = _mm512_load_si512(a->xh + 64 * c), xl = _mm512_load_si512(a->xl + 64 * c);
            for (int r = 0; r < ROWS; r++) {
                const __m512i v = _mm512_maskz_loadu_epi8(kb, q + step * r);
                const __m512i h = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v, xh);
                const __m512i l = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v, xl);
                __m512i t = _mm512_add_epi32(_mm512_slli_epi32(h, 7), l);
                if (has_off) t = _mm512_sub_epi32(t, corr);
                const __m512 sr = _mm512_mul_ps(_mm512_permutexvar_ps(idx[r], s), sx);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), sr, acc[r]);
            }
        }
    }
    for (int r = 0; r < n_valid; r++) {
        float v = _mm512_reduce_add_ps(acc[r]);
        if (mn) v += min_term((const char *)mn + (size_t)(n0 + r) * ng * (half ? 2 : 4), a->xsum, ng, half);
        y[n0 + r] = v;
    }
}

static Acts acts_row(const Acts *a, int m, int K, int G, int u4) {
    const size_t nc = n_chunks(K, u4), cb = u4 ? 128 : 64;
    Acts r = {a->xh + m * nc * cb, a->xl + m * nc * cb, a->sx + m * nc * 16,
              a->corr + m * nc * 16, a->xsum + (size_t)m * (K / G)};
    return r;
}

/* y[M, N] = x[M, K] @ W.T. qt: tiles [ceil(N / ROWS), n_chunks, ROWS, 64] bytes; st: scales
 * [ceil(N / ROWS), n_chunks, ROWS, groups per chunk]; mn: [N, K / G] or NULL; scales and mins
 * fp16 when half, else fp32. w = scale * (u - off) + min. Returns 0, or -1 when out of memory. */
int potluck_gemv(const uint8_t *qt, const void *st, const void *mn, const float *x, float *y,
                 int M, int N, int K, int G, int u4, int off, int half, int n_threads) {
    const size_t nc = n_chunks(K, u4), cb = u4 ? 128 : 64;
    Acts all = {aligned_alloc(64, M * nc * cb), aligned_alloc(64, M * nc * cb),
                aligned_alloc(64, M * nc * 64), aligned_alloc(64, M * nc * 64),
                malloc(sizeof(float) * M * (K / G))};
    int ok = all.xh && all.xl && all.sx && all.corr && all.xsum;
    if (ok) {
        for (int m = 0; m < M; m++) {
            Acts am = acts_row(&all, m, K, G, u4);
            prepare(x + (size_t)m * K, K, G, u4, off, &am);
        }
        const int gpc = 16 / lanes_per_group(G, u4), n_tiles = (N + ROWS - 1) / ROWS;
        #pragma omp parallel for num_threads(n_threads) schedule(static) if ((size_t)M * N * K >= PAR_MIN)
        for (int t = 0; t < n_tiles; t++) {
            const uint8_t *qtile = qt + (size_t)t * ROWS * row_bytes(K, u4);
            const char *stile = (const char *)st + (size_t)t * nc * ROWS * gpc * (half ? 2 : 4);
            const int n0 = t * ROWS, nv = N - n0 < ROWS ? N - n0 : ROWS;
            for (int m = 0; m < M; m++) {
                Acts am = acts_row(&all, m, K, G, u4);
                float *ym = y + (size_t)m * N;
                /* constant G, u4, half and offset per call site: each is specialised */
#define TILE(G_, U4_, HALF_, OFF_) tile(qtile, stile, mn, &am, ym, n0, nv, K, G_, U4_, HALF_, OFF_)
                if (u4 && off == 0) { if (half) TILE(32, 1, 1, 0); else TILE(32, 1, 0, 0); }
                else if (u4) { if (half) TILE(32, 1, 1, 1); else TILE(32, 1, 0, 1); }
                else if (G == 16) { if (half) TILE(16, 0, 1, 1); else TILE(16, 0, 0, 1); }
                else { if (half) TILE(32, 0, 1, 1); else TILE(32, 0, 0, 1); }
#undef TILE
            }
        }
    }
    free(all.xh); free(all.xl); free(all.sx); free(all.corr); free(all.xsum);
    return ok ? 0 : -1;
}

/* A weight as bound once from Python (native.Gemv): one short call per product. */
typedef struct {
    const uint8_t *qt;
    const void *st, *mn;
    int N, K, G, u4, off, half;
} Weight;

int potluck_gemv_w(const Weight *w, const float *x, float *y, int M, int n_threads) {
    return potluck_gemv(w->qt, w->st, w->mn, x, y, M, w->N, w->K, w->G, w->u4, w->off, w->half, n_threads);
}

/* fp32 -> bf16, round to nearest even (finite values). */
static inline __m256i to_bf16(__m512 v) {
    __m512i b = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    b = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(b, 16));
}

/* 16 fp32 -> 16 bf16 (round to nearest even; finite values) */
static inline __m256i bf16x16(__m512 v) {
#ifdef __AVX512BF16__
    return (__m256i)_mm512_cvtneps_pbh(v);
#else
    return to_bf16(v);
#endif
}

/* Rows [n0, n1) of the weight as bf16 [n1 - n0, K]: fma(scale, u - off, min), rounded once.
 * Tile by tile, chunk by chunk: a chunk's scales and mins are loaded once for its ROWS rows and
 * each group's broadcast is a register permute (≈ 0.05 ns per weight on one core, a third of a
 * row-by-row loop with scalar loads). */
void potluck_dequant_bf16(const uint8_t *qt, const void *st, const void *mn, uint16_t *out,
                          int n0, int n1, int K, int G, int u4, int off, int half, int n_threads) {
    const int ng = K / G, nc = n_chunks(K, u4), lpg = lanes_per_group(G, u4), gpc = 16 / lpg;
    const int rbytes = row_bytes(K, u4), n_full = rbytes / 64, tail = rbytes % 64;
    const int t0 = n0 / ROWS, t1 = (n1 + ROWS - 1) / ROWS;
    const __mmask16 ks = gpc * ROWS == 16 ? 0xFFFF : 0xFF;
    const __m512i vo = _mm512_set1_epi32(off);
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
    /* u4 tables: byte j of [lo | hi] for output byte p of groups 0-1 (2-3: + 32) */
    uint8_t p01[64], p23[64], g01[64], g23[64];
    for (int p = 0; p < 64; p++) {
        const int grp = p / 32, j = p % 16, high = (p % 32) >= 16;
        p01[p] = (uint8_t)(high * 64 + grp * 16 + j);
        p23[p] = (uint8_t)(p01[p] + 32);
        g01[p] = (uint8_t)(grp * 16);
        g23[p] = (uint8_t)(32 + grp * 16);
    }
    const __m512i pick01 = _mm512_loadu_si512(p01), pick23 = _mm512_loadu_si512(p23);
    const __m512i gofs01 = _mm512_loadu_si512(g01), gofs23 = _mm512_loadu_si512(g23);
#endif
    #pragma omp parallel for num_threads(n_threads) schedule(dynamic, 16) if ((size_t)(n1 - n0) * K >= PAR_MIN)
    for (int t = t0; t < t1; t++) {
        const uint8_t *qtile = qt + (size_t)t * ROWS * rbytes;
        const char *stile = (const char *)st + (size_t)t * nc * ROWS * gpc * (half ? 2 : 4);
        for (int c = 0; c < nc; c++) {
            const __m512 s = load16(stile, (size_t)c * ROWS * gpc, ks, half); /* [ROWS][gpc] */
            __m512 mc = _mm512_setzero_ps();
            if (mn) {
                const int gl = ng - c * gpc < gpc ? ng - c * gpc : gpc;
                for (int r = 0; r < ROWS && t * ROWS + r < n1; r++) {
                    const __mmask16 k = (__mmask16)(((1u << gl) - 1) << (r * gpc));
                    const size_t i = (size_t)(t * ROWS + r) * ng + (size_t)c * gpc - (size_t)r * gpc;
                    mc = half ? _mm512_mask_cvtph_ps(mc, k, _mm256_maskz_loadu_epi16(k, (const uint16_t *)mn + i))
                              : _mm512_mask_loadu_ps(mc, k, (const float *)mn + i);
                }
            }
            const int step = c < n_full ? 64 : tail;
            for (int r = 0; r < ROWS; r++) {
                const int n = t * ROWS + r;
                if (n < n0 || n >= n1) continue;
                const __m512i v = c < n_full ? _mm512_loadu_si512(qtile + (size_t)c * ROWS * 64 + 64 * r)
                                             : _mm512_maskz_loadu_epi8((1ULL << tail) - 1, qtile + (size_t)c * ROWS * 64 + step * r);
                uint16_t *o = out + (size_t)(n - n0) * K;
                const int gl = ng - c * gpc < gpc ? ng - c * gpc : gpc;
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
                if (u4) { /* a 16-entry bf16 table per group, the chunk's 4 in two registers */
                    const __m512 lv = _mm512_sub_ps(_mm512_cvtepi32_ps(lane), _mm512_set1_ps((float)off));
                    __m512 tf[4]; /* fma(scale, u - off, min) for u = 0..15: the same rounding */
                    for (int gi = 0; gi < 4; gi++) {
                        const __m512i bi = _mm512_set1_epi32(r * gpc + gi);
                        tf[gi] = _mm512_fmadd_ps(lv, _mm512_permutexvar_ps(bi, s), _mm512_permutexvar_ps(bi, mc));
                    }
                    const __m512i t01 = (__m512i)_mm512_cvtne2ps_pbh(tf[1], tf[0]);
                    const __m512i t23 = (__m512i)_mm512_cvtne2ps_pbh(tf[3], tf[2]);
                    const __m512i m4 = _mm512_set1_epi8(0x0F);
                    const __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                    /* per group, its low nibbles then its high ones (values j, j + 16), plus
                     * 16 * group: the entry of the value in [t01 | t23] */
                    const __m512i b01 = _mm512_add_epi8(_mm512_permutex2var_epi8(lo, pick01, hi), gofs01);
                    const __m512i b23 = _mm512_add_epi8(_mm512_permutex2var_epi8(lo, pick23, hi), gofs23);
                    const __m512i w[4] = {_mm512_cvtepu8_epi16(_mm512_castsi512_si256(b01)),
                                          _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(b01, 1)),
                                          _mm512_cvtepu8_epi16(_mm512_castsi512_si256(b23)),
                                          _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(b23, 1))};
                    for (int gi = 0; gi < gl; gi++)
                        _mm512_storeu_si512(o + 32 * (c * gpc + gi), _mm512_permutex2var_epi16(t01, w[gi], t23));
                    continue;
                }
#endif
                for (int gi = 0; gi < gl; gi++) {
                    const __m512i bi = _mm512_set1_epi32(r * gpc + gi);
                    const __m512 sg = _mm512_permutexvar_ps(bi, s), mg = _mm512_permutexvar_ps(bi, mc);
                    const int g = c * gpc + gi;
                    if (u4) { /* 16 bytes: values j (low nibbles) and j + 16 (high) */
                        const __m512i b = _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(v, 0) );
                        const __m512i bb = gi == 0 ? b : _mm512_cvtepu8_epi32(
                            gi == 1 ? _mm512_extracti32x4_epi32(v, 1) : gi == 2 ? _mm512_extracti32x4_epi32(v, 2)
                                                                        : _mm512_extracti32x4_epi32(v, 3));
                        /* u - off exact in int32, then one rounding: fma(scale, u - off, min) */
                        const __m512i lo = _mm512_sub_epi32(_mm512_and_si512(bb, _mm512_set1_epi32(15)), vo);
                        const __m512i hi = _mm512_sub_epi32(_mm512_srli_epi32(bb, 4), vo);
                        const __m512 wl = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), sg, mg);
                        const __m512 wh = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), sg, mg);
#ifdef __AVX512BF16__ /* one instruction for both, the same rounding (finite values) */
                        _mm512_storeu_si512(o + 32 * g, (__m512i)_mm512_cvtne2ps_pbh(wh, wl));
#else
                        _mm256_storeu_si256((__m256i *)(o + 32 * g), to_bf16(wl));
                        _mm256_storeu_si256((__m256i *)(o + 32 * g + 16), to_bf16(wh));
#endif
                    } else {
                        for (int j = 0; j < G; j += 16) {
                            const int p = gi * G + j; /* byte of the chunk row */
                            const __m128i b = p < 16 ? _mm512_extracti32x4_epi32(v, 0) : p < 32 ? _mm512_extracti32x4_epi32(v, 1)
                                            : p < 48 ? _mm512_extracti32x4_epi32(v, 2) : _mm512_extracti32x4_epi32(v, 3);
                            const __m512i u = _mm512_sub_epi32(_mm512_cvtepu8_epi32(b), vo);
                            const __m512 w = _mm512_fmadd_ps(_mm512_cvtepi32_ps(u), sg, mg);
                            _mm256_storeu_si256((__m256i *)(o + G * g + j), bf16x16(w));
                        }
                    }
                }
            }
        }
    }
}
/* y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w[r % w_rows]; x, y: [rows, D], w: [w_rows, D].
 * With a (not NULL): x[r] + a[r] is normalised and stored into s (the residual stream). */
void potluck_rms_norm(const float *x, const float *a, float *s, const float *w, float *y,
                      int rows, int D, int w_rows, float eps) {
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * D, *wr = w + (size_t)(r % w_rows) * D;
        float *yr = y + (size_t)r * D;
        __m512 acc = _mm512_setzero_ps();
        for (int i = 0; i < D; i += 16) {
            const __mmask16 k = D - i >= 16 ? 0xFFFF : (__mmask16)((1u << (D - i)) - 1);
            __m512 v = _mm512_maskz_loadu_ps(k, xr + i);
            if (a) {
                v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(k, a + (size_t)r * D + i));
                _mm512_mask_storeu_ps(s + (size_t)r * D + i, k, v);
            }
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        if (a) xr = s + (size_t)r * D;
        const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(acc) / D + eps));
        for (int i = 0; i < D; i += 16) {
            const __mmask16 k = D - i >= 16 ? 0xFFFF : (__mmask16)((1u << (D - i)) - 1);
            const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, xr + i), inv);
            _mm512_mask_storeu_ps(yr + i, k, _mm512_mul_ps(v, _mm512_maskz_loadu_ps(k, wr + i)));
        }
    }
}

/* e^x: 2^n * p(r), n = round(x log2 e), r = x - n ln 2 in two steps (Cody-Waite), p a degree-6
 * Taylor polynomial: ≈ 2 ulp. x is clamped to [-87, 88]. */
static inline __m512 exp_ps(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* Sums of 16 vectors as one vector: lane j = sum of v[j]'s lanes (a transpose-and-add tree,
 * ≈ 45 instructions instead of 16 horizontal reductions). */
static inline __m512 sum16(__m512 v[16]) {
    __m512 s[8], u[4], w[2];
    for (int i = 0; i < 8; i++) /* per 128-bit segment: [a0+a2, b0+b2, a1+a3, b1+b3] */
        s[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per segment: partial sums of keys 4i .. 4i + 3 */
        const __m512d a = _mm512_castps_pd(s[2 * i]), b = _mm512_castps_pd(s[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int i = 0; i < 2; i++) /* add segments 0 + 1 and 2 + 3 */
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88), _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}

#define MAX_HD 512 /* head dims the decode kernel handles (hd, hdv <= MAX_HD, multiples of 16) */

/* One query per head over keys [first, L) of a token-major cache (decode).
 * q: [H, hd]; kc: [L, Hkv, hd]; vc: [L, Hkv, hdv]; out: [H, hdv]. Head h reads kv head h / (H / Hkv).
 * Returns 0, or -1 for unsupported head dims or no memory. */
int potluck_attn_decode(const float *q, const float *kc, const float *vc, float *out,
                        int H, int Hkv, int hd, int hdv, int first, int L, float scale,
                        int n_threads) {
    if (hd % 16 || hdv % 16 || hd > MAX_HD || hdv > MAX_HD) return -1;
    const int G = H / Hkv, n = L - first, n16 = (n + 15) / 16 * 16;
    float *scores = malloc(sizeof(float) * (size_t)H * n16);
    if (!scores) return -1;
    #pragma omp parallel for num_threads(n_threads) schedule(static) if ((size_t)H * n * hd >= PAR_MIN / 4)
    for (int h = 0; h < H; h++) {
        float *s = scores + (size_t)h * n16;
        const float *qh = q + (size_t)h * hd;
        const size_t kstride = (size_t)Hkv * hd, vstride = (size_t)Hkv * hdv;
        const float *k0 = kc + ((size_t)first * Hkv + h / G) * hd;
        const float *v0 = vc + ((size_t)first * Hkv + h / G) * hdv;
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (int j0 = 0; j0 < n; j0 += 16) {
            __m512 acc[16];
            for (int t = 0; t < 16; t++) {
                acc[t] = _mm512_setzero_ps();
                if (j0 + t >= n) continue;
                const float *kj = k0 + (size_t)(j0 + t) * kstride;
                for (int i = 0; i < hd; i += 16)
                    acc[t] = _mm512_fmadd_ps(_mm512_loadu_ps(qh + i), _mm512_loadu_ps(kj + i), acc[t]);
            }
            const __mmask16 k = n - j0 >= 16 ? 0xFFFF : (__mmask16)((1u << (n - j0)) - 1);
            const __m512 sj = _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale));
            _mm512_storeu_ps(s + j0, sj);
            mx = _mm512_mask_max_ps(mx, k, mx, sj);
        }
        const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
        __m512 sum = _mm512_setzero_ps();
        for (int j = 0; j < n; j += 16) {
            const __mmask16 k = n - j >= 16 ? 0xFFFF : (__mmask16)((1u << (n - j)) - 1);
            const __m512 e = _mm512_maskz_mov_ps(k, exp_ps(_mm512_sub_ps(_mm512_loadu_ps(s + j), m)));
            _mm512_storeu_ps(s + j, e);
            sum = _mm512_add_ps(sum, e);
        }
        const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
        __m512 o[MAX_HD / 16];
        for (int i = 0; i < hdv / 16; i++) o[i] = _mm512_setzero_ps();
        for (int j = 0; j < n; j++) {
            const __m512 p = _mm512_set1_ps(s[j]);
            const float *vj = v0 + (size_t)j * vstride;
            for (int i = 0; i < hdv / 16; i++) o[i] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vj + 16 * i), o[i]);
        }
        for (int i = 0; i < hdv / 16; i++) _mm512_storeu_ps(out + (size_t)h * hdv + 16 * i, _mm512_mul_ps(o[i], inv));
    }
    free(scores);
    return 0;
}

/* One layer's attention shape, bound once from Python (native.DecodeAttention). */
typedef struct {
    const float *qk_norm; /* [H + Hkv, hd] RMSNorm weights of the q and k heads, or NULL */
    float eps, scale;
    int H, Hkv, hd, hdv;
} Attn;

/* One decoded token of one sequence: qkv = [q (H heads) | k (Hkv) | v (Hkv)] of the new position
 * pos. Optionally RMSNorm each q/k head; rotate q and k (RoPE in pair order: (2j, 2j+1) by
 * rope[pos][j] = (cos, sin)); store k and v at row pos of the caches; attend over keys
 * [first, pos]. qkv is modified in place; caches: [> pos, Hkv, hd | hdv]; out: [H, hdv]. */
int potluck_decode_attend(const Attn *a, float *qkv, const float *rope, float *kc, float *vc,
                          float *out, int pos, int first, int n_threads) {
    const int H = a->H, Hkv = a->Hkv, hd = a->hd, hdv = a->hdv;
    const float *rot = rope + (size_t)pos * hd; /* hd / 2 (cos, sin) pairs */
    if (a->qk_norm)
        potluck_rms_norm(qkv, NULL, NULL, a->qk_norm, qkv, H + Hkv, hd, H + Hkv, a->eps);
    for (int h = 0; h < H + Hkv; h++) {
        float *x = qkv + (size_t)h * hd;
        for (int i = 0; i < hd; i += 16) {
            const __mmask16 k = hd - i >= 16 ? 0xFFFF : (__mmask16)((1u << (hd - i)) - 1);
            const __m512 xv = _mm512_maskz_loadu_ps(k, x + i), r = _mm512_maskz_loadu_ps(k, rot + i);
            const __m512 swapped = _mm512_permute_ps(xv, 0xB1);                /* (b, a) pairs */
            const __m512 bs = _mm512_mul_ps(swapped, _mm512_movehdup_ps(r));   /* (b s, a s) */
            /* even lanes a c - b s, odd lanes b c + a s */
            _mm512_mask_storeu_ps(x + i, k, _mm512_fmaddsub_ps(xv, _mm512_moveldup_ps(r), bs));
        }
    }
    memcpy(kc + (size_t)pos * Hkv * hd, qkv + (size_t)H * hd, sizeof(float) * Hkv * hd);
    memcpy(vc + (size_t)pos * Hkv * hdv, qkv + (size_t)(H + Hkv) * hd, sizeof(float) * Hkv * hdv);
    return potluck_attn_decode(qkv, kc, vc, out, H, Hkv, hd, hdv, first, pos + 1, a->scale, n_threads);
}

/* out[t] = act(gate[t]) * up[t] with gu = [gate | up] per row: [T, 2F] -> [T, F].
 * act 0: silu g / (1 + e^-g); act 1: gelu, tanh form 0.5 g (1 + tanh z), z = sqrt(2/pi) (g +
 * 0.044715 g^3), computed as g / (1 + e^-2z): the same value without 1 + tanh z's cancellation
 * for negative g (torch's form loses ≈ 1e-3 relative at g = -4). */
void potluck_gated(const float *gu, float *out, int T, int F, int act) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int t = 0; t < T; t++) {
        const float *g = gu + (size_t)t * 2 * F, *u = g + F;
        float *o = out + (size_t)t * F;
        for (int i = 0; i < F; i += 16) {
            const __mmask16 k = F - i >= 16 ? 0xFFFF : (__mmask16)((1u << (F - i)) - 1);
            const __m512 x = _mm512_maskz_loadu_ps(k, g + i);
            __m512 y;
            if (act == 0) {
                y = _mm512_div_ps(x, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), x))));
            } else {
                const __m512 z2 = _mm512_mul_ps(_mm512_set1_ps(-1.5957691216057308f), /* -2 sqrt(2/pi) */
                    _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), x), _mm512_mul_ps(x, x), x));
                y = _mm512_div_ps(x, _mm512_add_ps(one, exp_ps(z2)));
            }
            _mm512_mask_storeu_ps(o + i, k, _mm512_mul_ps(y, _mm512_maskz_loadu_ps(k, u + i)));
        }
    }
}

/* ---- Batched products (prompt micro-batches of a few dozen rows) --------------------------------
 * Activations in 15-bit fixed point per group (the weight's group: 16 or 32 values), as the gemv
 * kernel: X = 128 Xh + Xl with the scale sx = amax / XMAX, |dx| <= amax / 32766. (8-bit
 * activations, as llama.cpp's q8_0, took 35 % less time but doubled the fast path's distance
 * to the fp32 reference on the real models, past what the tests allow.) Weights are taken
 * centred, u - 8 (u4) or u - 128 (u8); a u4 weight stored with offset 0 (Q4_1) adds 8 scales to
 * its min instead. A weight tile (ROWS rows) is loaded and unpacked once per chunk for MB
 * activation rows; per chunk and activation row, the ROWS rows' VNNI dot products (exact int32)
 * are summed per group into one vector (an integer transpose-and-add), lane 4 * segment + r, then
 * converted, scaled and accumulated once. Every output is computed in the same order whatever M,
 * the block a row falls in and the thread count: a row's result does not depend on the rows
 * batched with it. */
#define MB 8              /* activation rows per block (a last one of <= 4 rows: MB / 2) */
#define TB_BYTES 16384    /* weight bytes of the tiles a block of rows runs over (L1-resident) */
#define SLICE_BYTES 196608 /* prepared activations a pass over the weight takes (L2-resident) */

/* A row's activations, chunk by chunk, as records of rec_bytes: [Xh, Xl: 128 (u4) or 64 int8
 * each, in the weight chunk's byte order][sx: 16 fp32][xs: 16 fp32][corr: 16 int32]; lane j = 4 * segment + r
 * of the last three holds, for the chunk's group g of 128-bit segment j / 4 (u4 or G = 16: g =
 * j / 4, else j / 8): its scale; the exact sum of its x, halved for u8 with G = 32 (its 8 lanes
 * span two segments, both counted); centre * sum(X), halved likewise. */
static inline int rec_bytes(int u4) { return 2 * (u4 ? 128 : 64) + 192; }

static void prepare_rows(const float *x, int K, int G, int u4, int centre, uint8_t *rec) {
    const int ng = K / G, nc = n_chunks(K, u4), cb = u4 ? 128 : 64, rb = rec_bytes(u4);
    const int lpg = lanes_per_group(G, u4), gpc = 16 / lpg;
    memset(rec, 0, (size_t)nc * rb);
    const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    float gsx[4], gxs[4]; /* per group of the current chunk */
    int32_t gcs[4];
    for (int g = 0; g < ng; g++) {
        const __m512 v0 = _mm512_loadu_ps(x + (size_t)g * G);
        const __m512 v1 = G == 32 ? _mm512_loadu_ps(x + (size_t)g * G + 16) : _mm512_setzero_ps();
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(v0, sign), _mm512_and_ps(v1, sign)));
        const float xsum = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
        const __m512 inv = _mm512_set1_ps(amax > 0.0f ? XMAX / amax : 0.0f);
        const __m512i X0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)); /* round to nearest even */
        const __m512i X1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
        const int c = g / gpc, gi = g % gpc;
        uint8_t *r = rec + (size_t)c * rb;
        const int p0 = u4 ? gi * 16 : gi * G, p1 = u4 ? p0 + 64 : p0 + 16;
        const __m512i m127 = _mm512_set1_epi32(127);
        _mm_storeu_si128((__m128i *)(r + p0), _mm512_cvtepi32_epi8(_mm512_srai_epi32(X0, 7)));
        _mm_storeu_si128((__m128i *)(r + cb + p0), _mm512_cvtepi32_epi8(_mm512_and_si512(X0, m127)));
        if (G == 32) {
            _mm_storeu_si128((__m128i *)(r + p1), _mm512_cvtepi32_epi8(_mm512_srai_epi32(X1, 7)));
            _mm_storeu_si128((__m128i *)(r + cb + p1), _mm512_cvtepi32_epi8(_mm512_and_si512(X1, m127)));
        }
        gsx[gi] = amax / XMAX;
        gxs[gi] = xsum * (4.0f / lpg);
        /* u8, G = 32: centre = 128 is even, so is the halved sum */
        gcs[gi] = centre * _mm512_reduce_add_epi32(_mm512_add_epi32(X0, X1)) / (lpg / 4);
        if (gi == gpc - 1 || g == ng - 1) { /* the chunk's groups to their lanes */
            const __m512i gl = _mm512_srli_epi32(lane, lpg == 4 ? 2 : 3);
            const __mmask16 k = (__mmask16)((1u << (gi + 1)) - 1);
            _mm512_store_ps(r + 2 * cb, _mm512_permutexvar_ps(gl, _mm512_maskz_loadu_ps(k, gsx)));
            _mm512_store_ps(r + 2 * cb + 64, _mm512_permutexvar_ps(gl, _mm512_maskz_loadu_ps(k, gxs)));
            _mm512_store_si512(r + 2 * cb + 128, _mm512_permutexvar_epi32(gl, _mm512_maskz_loadu_epi32(k, gcs)));
        }
    }
}

/* One tile (ROWS weight rows) against MB rows of prepared activations (records rstride bytes
 * apart); writes y[m * ldy + n0 + r] for m < nm, r < nv. */
static inline __attribute__((always_inline)) void tile_rows(
    const uint8_t *qt, const void *st, const void *mn, const uint8_t *acts, size_t rstride,
    float *y, size_t ldy, int nm, int n0, int nv, int K, int G, int u4, int half, int shift,
    int has_min, const int MB_) {
    const int nc = n_chunks(K, u4), ng = K / G, cb = u4 ? 128 : 64, rb = rec_bytes(u4);
    const int lpg = lanes_per_group(G, u4), gpc = 16 / lpg;
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    /* lane 4 * seg + r takes the tile's scale [r][g] (at r * gpc + g), g = the segment's group */
    const __m512i tidx = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_and_si512(lane, _mm512_set1_epi32(3)), _mm512_set1_epi32(gpc)),
                                          _mm512_srli_epi32(lane, lpg == 4 ? 2 : 3));
    const __mmask16 ks = gpc * ROWS == 16 ? 0xFFFF : 0xFF;
    __m512 acc[MB];
    for (int m = 0; m < MB_; m++) acc[m] = _mm512_setzero_ps();
    const int tail = row_bytes(K, u4) % 64, n_full = row_bytes(K, u4) / 64;
    for (int c = 0; c < nc; c++) {
        const int step = c < n_full ? 64 : tail;
        const __mmask64 kb = c < n_full ? ~0ULL : (1ULL << tail) - 1;
        const uint8_t *q = qt + (size_t)c * ROWS * 64;
        const __m512 s = _mm512_permutexvar_ps(tidx, load16(st, (size_t)c * ROWS * gpc, ks, half));
        __m512 mc = _mm512_setzero_ps();
        if (has_min) { /* the tile's mins of this chunk, [ROWS][gpc], then in lane order */
            const int gl = ng - c * gpc < gpc ? ng - c * gpc : gpc;
            for (int r = 0; r < nv; r++) {
                const __mmask16 k = (__mmask16)(((1u << gl) - 1) << (r * gpc));
                const size_t i = (size_t)(n0 + r) * ng + (size_t)c * gpc - (size_t)r * gpc;
                mc = half ? _mm512_mask_cvtph_ps(mc, k, _mm256_maskz_loadu_epi16(k, (const uint16_t *)mn + i))
                          : _mm512_mask_loadu_ps(mc, k, (const float *)mn + i);
            }
            mc = _mm512_permutexvar_ps(tidx, mc);
        }
        if (shift) mc = _mm512_fmadd_ps(_mm512_set1_ps(8.0f), s, mc); /* s (u - 8) + min + 8 s */
        __m512i lo[ROWS], hi[ROWS];
        for (int r = 0; r < ROWS; r++) {
            const __m512i v = c < n_full ? _mm512_loadu_si512(q + 64 * r) : _mm512_maskz_loadu_epi8(kb, q + step * r);
            lo[r] = u4 ? _mm512_and_si512(v, m4) : v;
            hi[r] = u4 ? _mm512_and_si512(_mm512_srli_epi16(v, 4), m4) : v;
        }
        for (int m = 0; m < MB_; m++) {
            const uint8_t *a = acts + m * rstride + (size_t)c * rb;
            /* Xh and Xl of the values the low and the high nibbles multiply (u8: one half) */
            const __m512i hl = _mm512_load_si512(a), hh = _mm512_load_si512(a + 64);
            const __m512i ll = _mm512_load_si512(a + cb), lh = _mm512_load_si512(a + cb + 64);
            __m512i t[ROWS];
            for (int r = 0; r < ROWS; r++) {
                __m512i h = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[r], hl);
                __m512i l = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[r], ll);
                if (u4) {
                    h = _mm512_dpbusd_epi32(h, hi[r], hh);
                    l = _mm512_dpbusd_epi32(l, hi[r], lh);
                }
                t[r] = _mm512_add_epi32(_mm512_slli_epi32(h, 7), l);
            }
            /* per 128-bit segment: [sum t0, sum t1, sum t2, sum t3] (see sum16) */
            const __m512i p = _mm512_add_epi32(_mm512_unpacklo_epi32(t[0], t[1]), _mm512_unpackhi_epi32(t[0], t[1]));
            const __m512i p2 = _mm512_add_epi32(_mm512_unpacklo_epi32(t[2], t[3]), _mm512_unpackhi_epi32(t[2], t[3]));
            __m512i d = _mm512_add_epi32(_mm512_unpacklo_epi64(p, p2), _mm512_unpackhi_epi64(p, p2));
            d = _mm512_sub_epi32(d, _mm512_load_si512(a + 2 * cb + 128));
            const __m512 sx = _mm512_mul_ps(s, _mm512_load_ps((const float *)(a + 2 * cb)));
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), sx, acc[m]);
            if (has_min || shift)
                acc[m] = _mm512_fmadd_ps(mc, _mm512_load_ps((const float *)(a + 2 * cb + 64)), acc[m]);
        }
    }
    for (int m = 0; m < nm; m++) { /* row r: lanes r, 4 + r, 8 + r, 12 + r */
        const __m512 e = _mm512_add_ps(acc[m], _mm512_shuffle_f32x4(acc[m], acc[m], 0x4E));
        const __m128 o = _mm512_castps512_ps128(_mm512_add_ps(e, _mm512_shuffle_f32x4(e, e, 0xB1)));
        if (nv == ROWS) _mm_storeu_ps(y + m * ldy + n0, o);
        else {
            float f[4];
            _mm_storeu_ps(f, o);
            for (int r = 0; r < nv; r++) y[m * ldy + n0 + r] = f[r];
        }
    }
}

/* Blocks of a slice: tiles [t0, t1) against activation rows [m_lo, m_hi) (multiples of MB). */
typedef struct {
    const Weight *w;
    const uint8_t *acts;
    size_t rstride;
    float *y;
    int M;
} JobB;

static inline __attribute__((always_inline)) void run_rows(
    const JobB *j, int m_lo, int m_hi, int t0, int t1, int G, int u4, int half, int shift,
    int has_min) {
    const Weight *w = j->w;
    const int N = w->N, K = w->K, nc = n_chunks(K, u4), gpc = 16 / lanes_per_group(G, u4);
    const size_t tile_bytes = (size_t)ROWS * row_bytes(K, u4);
    const size_t st_bytes = (size_t)nc * ROWS * gpc * (half ? 2 : 4);
    for (int m0 = m_lo; m0 < m_hi; m0 += MB) {
        const uint8_t *a = j->acts + m0 * j->rstride;
        float *ym = j->y + (size_t)m0 * N;
        const int nm = j->M - m0 < MB ? j->M - m0 : MB;
        for (int t = t0; t < t1; t++) {
            const int n0 = t * ROWS, nv = N - n0 < ROWS ? N - n0 : ROWS;
            const uint8_t *qtile = w->qt + t * tile_bytes;
            const char *stile = (const char *)w->st + t * st_bytes;
            if (nm > MB / 2)
                tile_rows(qtile, stile, w->mn, a, j->rstride, ym, N, nm, n0, nv, K, G, u4, half, shift, has_min, MB);
            else /* the same arithmetic per row, fewer rows */
                tile_rows(qtile, stile, w->mn, a, j->rstride, ym, N, nm, n0, nv, K, G, u4, half, shift, has_min, MB / 2);
        }
    }
}

/* One function per (G, u4, half, shift, mins): each compiled with its constants. */
typedef void (*RunRows)(const JobB *, int, int, int, int);
#define RB(G_, U4_, H_, S_, MN_) \
    static void runb_##G_##_##U4_##_##H_##_##S_##_##MN_(const JobB *j, int a, int b, int c, int d) { \
        run_rows(j, a, b, c, d, G_, U4_, H_, S_, MN_); }
#define RBS(G_, U4_) RB(G_, U4_, 0, 0, 0) RB(G_, U4_, 0, 0, 1) RB(G_, U4_, 0, 1, 0) RB(G_, U4_, 0, 1, 1) \
    RB(G_, U4_, 1, 0, 0) RB(G_, U4_, 1, 0, 1) RB(G_, U4_, 1, 1, 0) RB(G_, U4_, 1, 1, 1)
RBS(32, 1) RBS(16, 0) RBS(32, 0)
#define RBN(G_, U4_) runb_##G_##_##U4_##_0_0_0, runb_##G_##_##U4_##_0_0_1, runb_##G_##_##U4_##_0_1_0, \
    runb_##G_##_##U4_##_0_1_1, runb_##G_##_##U4_##_1_0_0, runb_##G_##_##U4_##_1_0_1, \
    runb_##G_##_##U4_##_1_1_0, runb_##G_##_##U4_##_1_1_1
static const RunRows RUN_ROWS[24] = {RBN(32, 1), RBN(16, 0), RBN(32, 0)};
#undef RBN
#undef RBS
#undef RB

/* y[M, N] = x[M, K] @ W.T with 8-bit activations (see above). Returns 0, or -1 when out of
 * memory. */
int potluck_gemm_w(const Weight *w, const float *x, float *y, int M, int n_threads) {
    const int N = w->N, K = w->K, G = w->G, u4 = w->u4;
    const int nc = n_chunks(K, u4), mp = (M + MB - 1) / MB * MB;
    const int centre = u4 ? 8 : 128, shift = centre != w->off;
    const size_t rstride = (size_t)nc * rec_bytes(u4);
    uint8_t *acts = aligned_alloc(64, (size_t)mp * rstride);
    if (!acts) return -1;
    #pragma omp parallel for num_threads(n_threads) schedule(dynamic, 8) if ((size_t)M * K >= PAR_MIN / 4)
    for (int m = 0; m < mp; m++) {
        if (m < M) prepare_rows(x + (size_t)m * K, K, G, u4, centre, acts + m * rstride);
        else memset(acts + m * rstride, 0, rstride);
    }
    const int n_tiles = (N + ROWS - 1) / ROWS, tile_bytes = ROWS * row_bytes(K, u4);
    const int tb = TB_BYTES / tile_bytes > 1 ? TB_BYTES / tile_bytes : 1;
    const int n_blocks = (n_tiles + tb - 1) / tb;
    const RunRows run = RUN_ROWS[(u4 ? 0 : G == 16 ? 1 : 2) * 8 + w->half * 4 + shift * 2 + (w->mn != NULL)];
    const JobB job = {w, acts, rstride, y, M};
    /* rows in slices whose records stay in L2 while the weight passes. Blocks are handed out
     * one by one (dynamic): on a shared machine a thread may wait for its core for a time slice
     * (ms), and with a static split half the work would wait with it. */
    const int slice = SLICE_BYTES / rstride / MB * MB > MB ? SLICE_BYTES / rstride / MB * MB : MB;
    #pragma omp parallel num_threads(n_threads) if ((size_t)M * N * K >= PAR_MIN)
    for (int ms = 0; ms < mp; ms += slice)
    #pragma omp for schedule(dynamic, 1) nowait
    for (int b = 0; b < n_blocks; b++) {
        const int t1 = (b + 1) * tb < n_tiles ? (b + 1) * tb : n_tiles;
        run(&job, ms, ms + slice < mp ? ms + slice : mp, b * tb, t1);
    }
    free(acts);
    return 0;
}

/* -- waiting for the next request without letting the core sleep (see spin_readable) -- */
#include <poll.h>
#include <sched.h>
#include <time.h>

static volatile int computing_now = 0; /* threads of this process inside a stage's compute */
static volatile int spinning_now = 0;  /* 1 while one thread of this process spins */

static long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* 1: fd is readable; 0: the budget ran out; -1: not polling (another thread of this process
 * polls, or a stage computes here: the caller should block) */
int potluck_spin_readable(int fd, long long budget_ns) {
    if (__atomic_exchange_n(&spinning_now, 1, __ATOMIC_ACQUIRE)) return -1;
    const long long end = now_ns() + budget_ns;
    struct pollfd p = {fd, POLLIN, 0};
    int ready = 0;
    for (;;) {
        if (poll(&p, 1, 0) != 0) { ready = 1; break; } /* data, end of stream or an error */
        if (__atomic_load_n(&computing_now, __ATOMIC_RELAXED)) { ready = -1; break; }
        if (now_ns() >= end) break;
        sched_yield(); /* whatever else wants this core (the head, a reply's reader) runs first */
    }
    __atomic_store_n(&spinning_now, 0, __ATOMIC_RELEASE);
    return ready;
}

void potluck_computing(int delta) { __atomic_add_fetch(&computing_now, delta, __ATOMIC_RELAXED); }
"""

_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
_P, _I = ctypes.c_void_p, ctypes.c_int


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


_why_not: list[str] = []  # why library() is None, for `unavailable_reason`


def unavailable_reason() -> str | None:
    """Why the native kernels are not in use here (None when they are)."""
    return None if library() is not None else (_why_not[-1] if _why_not else "unknown")


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None where they cannot be built or run here (see module doc)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    flags = _cpu_flags()
    if platform.machine() not in ("x86_64", "AMD64") or "avx512_vnni" not in flags:
        _why_not.append(f"needs an x86-64 CPU with AVX-512 VNNI ({platform.machine()})")
        return None
    if cc is None:
        _why_not.append("no C compiler (cc or gcc) on PATH")
        return None
    key = hashlib.sha256("\0".join([_SOURCE, *_FLAGS, flags]).encode()).hexdigest()[:16]
    path = cache_dir() / "kernels" / f"potluck-kernels-{key}.so"
    if not path.is_file() and not _compile(cc, path):
        return None
    # Linked against libgomp.so.1, which resolves to the copy torch already loaded: one OpenMP
    # runtime, one thread pool.
    lib = ctypes.CDLL(str(path))
    lib.potluck_gemv_w.argtypes = [_P, _P, _P, _I, _I]
    lib.potluck_gemv_w.restype = _I
    lib.potluck_gemm_w.argtypes = [_P, _P, _P, _I, _I]
    lib.potluck_gemm_w.restype = _I
    lib.potluck_dequant_bf16.argtypes = [_P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _I]
    lib.potluck_dequant_bf16.restype = None
    lib.potluck_rms_norm.argtypes = [_P, _P, _P, _P, _P, _I, _I, _I, ctypes.c_float]
    lib.potluck_rms_norm.restype = None
    lib.potluck_attn_decode.argtypes = [_P, _P, _P, _P, _I, _I, _I, _I, _I, _I, ctypes.c_float, _I]
    lib.potluck_attn_decode.restype = _I
    lib.potluck_decode_attend.argtypes = [_P, _P, _P, _P, _P, _P, _I, _I, _I]
    lib.potluck_decode_attend.restype = _I
    lib.potluck_gated.argtypes = [_P, _P, _I, _I, _I]
    lib.potluck_gated.restype = None
    lib.potluck_spin_readable.argtypes = [_I, ctypes.c_longlong]
    lib.potluck_spin_readable.restype = _I
    lib.potluck_computing.argtypes = [_I]
    lib.potluck_computing.restype = None
    _keep_large_blocks()
    return lib


# glibc malloc: blocks from this size up are mmapped (and page-faulted, zeroed) on every allocation;
# freed memory past the trim size at the heap's top goes back to the OS.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's own ceiling for its dynamic threshold


def _keep_large_blocks() -> None:
    """Keep prefill's large activations (MBs each) on the heap, reused from call to call.

    glibc raises its mmap threshold (up to 32 MiB) when a large mmapped block is freed, and loading
    a model used to free several (whole-matrix conversions of the weights); native layers are now
    packed in small runs, nothing large is freed, the threshold stays low and every large tensor
    of a 512-token micro-batch was mmapped and faulted in anew: 24 k page faults per SmolLM2
    prompt, ≈ 8 % of its prefill time. Setting the thresholds to what that load left (mmap 32 MiB,
    trim twice that, as glibc's dynamic rule does) restores it. No-op without glibc."""
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return  # not glibc
    mallopt.argtypes, mallopt.restype = [_I, _I], _I
    mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)
    mallopt(_M_TRIM_THRESHOLD, 2 * _MMAP_THRESHOLD_BYTES)


def release_free_memory() -> None:
    """glibc's malloc_trim: the heap's free pages go back to the OS (a few ms; no-op elsewhere)."""
    try:
        libc = ctypes.CDLL(None)
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], _I
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        return  # not glibc


def trim_heap() -> None:
    """Collect garbage, then give freed heap memory back to the OS (glibc's malloc_trim; only the
    collection without glibc).

    With the mmap threshold at 32 MiB (above), blocks of a few MiB live on the heap and stay in the
    process after they are freed: the node's speed probe alone left ≈ 85 MiB, and a replaced or
    idle-freed plan its whole stage. A node calls this after such frees (not on the token path:
    it walks the heap)."""
    gc.collect()  # a dropped stage may sit in a reference cycle
    release_free_memory()


_HUGE = 2 << 20  # an x86-64 / arm64 transparent huge page


_MADV_COLLAPSE = 25  # Linux 6.1 <asm-generic/mman-common.h> (not in Python's mmap module)


def collapse_in_place(t: torch.Tensor) -> bool:
    """Back the whole 2 MiB pages inside a large tensor's memory with huge pages where it lies
    (MADV_HUGEPAGE + MADV_COLLAPSE, Linux 6.1+): True if the kernel did. For tensors of tens of
    MiB, which malloc maps on their own: moving one into the arena would hold two copies at once."""
    if platform.system() != "Linux" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    a = t.data_ptr()
    lo, hi = -(-a // _HUGE) * _HUGE, (a + t.numel() * t.element_size()) // _HUGE * _HUGE
    if hi <= lo:
        return False
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return False
    madvise.argtypes, madvise.restype = [_P, ctypes.c_size_t, _I], _I
    return (
        madvise(lo, hi - lo, mmap.MADV_HUGEPAGE) == 0 and madvise(lo, hi - lo, _MADV_COLLAPSE) == 0
    )


def huge_page_arena(nbytes: int) -> torch.Tensor | None:
    """`nbytes` of fresh memory (uint8, 64-byte aligned, starting on a 2 MiB boundary) that the
    OS backs with 2 MiB pages as it is first written; None where it cannot (not Linux, or
    transparent huge pages switched off): use ordinary memory then.

    Why: decode streams every weight byte once per token; in 4 KiB pages that is ≈ 25 k TLB
    misses per SmolLM2 token, and the page walks cost 10-20 % of its time (one core, one process,
    two runs: 7.8-9.7 ms per token in 4 KiB pages, 7.1-7.8 ms in 2 MiB ones). The usual THP setting
    ("madvise") gives huge pages only to memory that asks (MADV_HUGEPAGE), and a stage's weights
    are hundreds of heap blocks between other data; in one mapping of their own they are
    contiguous, whatever the heap looks like after a process has loaded and freed other stages."""
    if platform.system() != "Linux" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    try:
        if "[never]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text():
            return None
    except OSError:
        return None
    # anonymous and private (not shared: shared memory has its own huge-page setting)
    mem = mmap.mmap(-1, nbytes + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mem.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        mem.close()
        return None
    base = ctypes.addressof(ctypes.c_char.from_buffer(mem))
    skip = -base % _HUGE
    # (the tensor keeps `mem` alive; the mapping goes when the last view of it does)
    return torch.frombuffer(mem, dtype=torch.uint8, offset=skip, count=nbytes)


READABLE, TIMED_OUT, NOT_POLLING = 1, 0, -1  # what poll_readable says


def poll_readable(fd: int, budget_s: float) -> int:
    """Wait for `fd` to be readable by polling it in a loop (ctypes releases the GIL meanwhile),
    for at most `budget_s`: READABLE (data, its end, or an error), TIMED_OUT, or NOT_POLLING (no
    native library, no budget, another thread of this process polls already, or a stage computes
    here: `computing`), after which the caller blocks as usual. Each round yields the core to
    whatever else wants it. Why a node polls: transport/spin.py."""
    lib = library()
    if lib is None or budget_s <= 0:
        return NOT_POLLING
    return int(lib.potluck_spin_readable(fd, int(budget_s * 1e9)))


def spin_readable(fd: int, budget_s: float) -> bool:
    """`poll_readable(fd, budget_s) == READABLE`."""
    return poll_readable(fd, budget_s) == READABLE


@contextlib.contextmanager
def computing() -> Iterator[None]:
    """`with computing():` around a stage's compute: no thread of this process spins meanwhile
    (a spinning thread would take the core from the compute on a single-core worker)."""
    lib = library()
    if lib is None:
        yield
        return
    lib.potluck_computing(1)
    try:
        yield
    finally:
        lib.potluck_computing(-1)


def _compile(cc: str, path: Path) -> bool:
    """Build the library into `path` (atomically: workers may start together). False on failure."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        src, out = Path(tmp) / "kernels.c", Path(tmp) / "kernels.so"
        src.write_text(_SOURCE)
        try:
            subprocess.run([cc, *_FLAGS, str(src), "-o", str(out)], check=True,
                           capture_output=True, timeout=120)  # fmt: skip
        except subprocess.CalledProcessError as e:
            _why_not.append(f"{cc} failed: {e.stderr.decode(errors='replace')[-2000:]}")
            return False  # torch's kernels are used instead
        except (OSError, subprocess.TimeoutExpired) as e:
            _why_not.append(f"{cc} did not run: {e}")
            return False
        os.replace(out, path)
    return True


@dataclass(frozen=True)
class Format:
    """How a weight is held: w = scale * (u - offset) + min per group of `group` weights.

    u4: 4-bit u (group 32), else 8-bit u (group 16 or 32); half: scales and mins stored as fp16
    (chosen only where that is exact, e.g. the fp16 d and m of Q4_0/Q4_1/Q5_0/Q8_0).
    """

    u4: bool
    group: int
    offset: int
    half: bool = False

    @property
    def scale_dtype(self) -> torch.dtype:
        return torch.float16 if self.half else torch.float32


def n_chunks(n_in: int, u4: bool) -> int:
    """64-byte chunks per row: u4 packs 128 weights in one, u8 64."""
    return -(-n_in // (128 if u4 else 64))


def pack(
    u: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor | None, fmt: Format
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Tile a weight for the kernels.

    u: uint8 [N, K] values, or for u4 [N, K / 2] bytes each holding two: in every group of 32,
    byte j has value j in its low nibble and value j + 16 in its high one (GGML's Q4_0 order).
    scale, mins: fp32 [N, K / group] (mins may be None).
    Returns qt uint8 [ceil(N / 4), 4 * row bytes]: per tile of 4 rows their full 64-byte chunks
    chunk by chunk ([n_full, 4, 64]), then the rows' short last chunks if any ([4, tail]); st
    [ceil(N / 4), n_chunks, 4, gpc] (gpc = groups per chunk: 4, or 2 for u8 with group 32),
    zero-padded past N and past K; mins [N, K / group]. st and mins in fmt.scale_dtype.
    """
    n, row_bytes = u.shape
    k = row_bytes * (2 if fmt.u4 else 1)
    nc, gpc = n_chunks(k, fmt.u4), (4 if fmt.u4 or fmt.group == 16 else 2)
    n_full, tail = divmod(row_bytes, CHUNK_BYTES)
    n_pad = -(-n // TILE_ROWS) * TILE_ROWS
    if n_pad != n:
        u = torch.cat([u, u.new_zeros(n_pad - n, row_bytes)])
    tiles = u.view(-1, TILE_ROWS, row_bytes)
    full = tiles[:, :, : n_full * CHUNK_BYTES].unflatten(-1, (n_full, CHUNK_BYTES))
    parts = [full.transpose(1, 2).reshape(tiles.shape[0], -1)]  # [n_full][ROWS][64] per tile
    if tail:  # the short last chunk: [ROWS][tail]
        parts.append(tiles[:, :, n_full * CHUNK_BYTES :].reshape(tiles.shape[0], -1))
    qt = torch.cat(parts, dim=1) if tail else parts[0].contiguous()
    sb = torch.zeros(n_pad, nc * gpc, dtype=fmt.scale_dtype)
    sb[:n, : scale.shape[1]] = scale
    st = sb.view(-1, TILE_ROWS, nc, gpc).transpose(1, 2).contiguous()
    return qt, st, None if mins is None else mins.to(fmt.scale_dtype).contiguous()


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class _Weight(ctypes.Structure):
    _fields_ = [("qt", _P), ("st", _P), ("mn", _P)] + [
        (f, _I) for f in ["N", "K", "G", "u4", "off", "half"]
    ]


class Gemv:
    """A tiled weight bound to the kernel: pointers and shape sit in a C struct made once, so a
    product is one 5-argument call (ctypes converts every argument: ≈ 1.5 µs for 13 of them,
    0.6 µs for 5). Holds the tensors it points into."""

    def __init__(
        self,
        qt: torch.Tensor,
        st: torch.Tensor,
        mins: torch.Tensor | None,
        shape: tuple[int, int],
        fmt: Format,
    ) -> None:
        lib = library()
        assert lib is not None, "native kernels are not available"
        self.tensors = (qt, st, mins)
        n_out, n_in = shape
        self.n_out = n_out
        self._w = _Weight(qt.data_ptr(), st.data_ptr(), _ptr(mins), n_out, n_in, fmt.group,
                          fmt.u4, fmt.offset, fmt.half)  # fmt: skip
        self._ref = ctypes.byref(self._w)
        self._fn = lib.potluck_gemv_w
        self._fn_batched = lib.potluck_gemm_w

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x fp32 [M, K] contiguous -> fp32 [M, n_out]."""
        m = x.shape[0]
        y = torch.empty(m, self.n_out)
        if self._fn(self._ref, x.data_ptr(), y.data_ptr(), m, torch.get_num_threads()):
            raise MemoryError(f"native gemv: no memory for {m} prepared activation rows")
        return y

    def batched(self, x: torch.Tensor) -> torch.Tensor:
        """x fp32 [M, K] contiguous -> fp32 [M, n_out], activations as 8-bit integers per group
        (potluck_gemm_w): for prompt micro-batches."""
        m = x.shape[0]
        y = torch.empty(m, self.n_out)
        if self._fn_batched(self._ref, x.data_ptr(), y.data_ptr(), m, torch.get_num_threads()):
            raise MemoryError(f"native gemm: no memory for {m} prepared activation rows")
        return y


def dequant_bf16(
    qt: torch.Tensor,
    st: torch.Tensor,
    mins: torch.Tensor | None,
    rows: tuple[int, int],
    n_in: int,
    fmt: Format,
) -> torch.Tensor:
    """Rows [start, stop) of the weight as dense bf16 [stop - start, n_in]."""
    lib = library()
    assert lib is not None, "native kernels are not available"
    start, stop = rows
    out = torch.empty(stop - start, n_in, dtype=torch.bfloat16)
    lib.potluck_dequant_bf16(
        qt.data_ptr(), st.data_ptr(), _ptr(mins), out.data_ptr(), start, stop, n_in,
        fmt.group, fmt.u4, fmt.offset, fmt.half, torch.get_num_threads(),
    )  # fmt: skip
    return out


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """ops.rms_norm for a contiguous fp32 x [..., D]; weight [D] or [W, D] (row r of x's rows
    uses weight row r % W). One call instead of six ops (≈ 2 vs 12-20 µs at D = 576).

    residual (x's shape): normalise s = x + residual instead. Returns (s or x, the norm)."""
    lib = library()
    assert lib is not None, "native kernels are not available"
    d = x.shape[-1]
    y = torch.empty_like(x)
    s = x if residual is None else torch.empty_like(x)
    lib.potluck_rms_norm(
        x.data_ptr(), _ptr(residual), s.data_ptr(), weight.data_ptr(), y.data_ptr(),
        x.numel() // d, d, weight.numel() // d, eps,
    )  # fmt: skip
    return s, y


GATED_ACTS = {"silu": 0, "gelu_tanh": 1}


def gated(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up for gate_up = [gate | up], contiguous fp32 [T, 2F] -> [T, F]; one call
    instead of two slices and two ops. exp to ≈ 2 ulp (torch's: ≈ 1)."""
    lib = library()
    assert lib is not None, "native kernels are not available"
    t, f2 = gate_up.shape
    out = torch.empty(t, f2 // 2)
    lib.potluck_gated(gate_up.data_ptr(), out.data_ptr(), t, f2 // 2, GATED_ACTS[activation])
    return out


class _Attn(ctypes.Structure):
    _fields_ = [("qk_norm", _P), ("eps", ctypes.c_float), ("scale", ctypes.c_float)] + [
        (f, _I) for f in ("H", "Hkv", "hd", "hdv")
    ]


class DecodeAttention:
    """One layer's attention for a single decoded token, bound once: (q/k RMSNorm,) RoPE, the KV
    cache write and attention in one 9-argument call instead of ≈ 20 ops and 14-argument calls
    (≈ 25 µs less per layer at SmolLM2 shapes)."""

    def __init__(
        self,
        n_head: int,
        n_kv: int,
        head_dims: tuple[int, int],
        scale: float,
        qk_norm: torch.Tensor | None = None,
        eps: float = 0.0,
    ) -> None:
        lib = library()
        assert lib is not None, "native kernels are not available"
        hd, hdv = head_dims
        assert attention_decode_fits(hd, hdv)
        self.qk_norm = qk_norm  # [n_head + n_kv, hd] contiguous fp32, kept alive here
        self.out_features = n_head * hdv
        self._a = _Attn(_ptr(qk_norm), eps, scale, n_head, n_kv, hd, hdv)
        self._ref = ctypes.byref(self._a)
        self._fn = lib.potluck_decode_attend

    def __call__(
        self,
        qkv: torch.Tensor,
        rope: torch.Tensor,
        caches: tuple[torch.Tensor, torch.Tensor],
        pos: int,
        first: int,
    ) -> torch.Tensor:
        """qkv: contiguous fp32 [1, (H + Hkv) hd + Hkv hdv], changed in place; rope: complex64
        [> pos, hd / 2]; caches: contiguous K and V buffers [> pos, Hkv, dim] -> [1, H hdv]."""
        k_cache, v_cache = caches
        out = torch.empty(1, self.out_features)
        rc = self._fn(
            self._ref, qkv.data_ptr(), rope.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
            out.data_ptr(), pos, first, torch.get_num_threads(),
        )  # fmt: skip
        if rc:
            raise MemoryError(f"native attention: no memory for {pos + 1 - first} scores")
        return out


def attention_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int, scale: float
) -> torch.Tensor:
    """One query per head over keys [first, L): q [H, hd], k [L, Hkv, hd] and v [L, Hkv, hdv]
    contiguous, token-major -> [1, H * hdv]. fp32 throughout; exp to ≈ 2 ulp."""
    lib = library()
    assert lib is not None, "native kernels are not available"
    h, hd = q.shape
    n_kv, hdv = k.shape[1], v.shape[2]
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    out = torch.empty(1, h * hdv)
    rc = lib.potluck_attn_decode(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), h, n_kv, hd, hdv, first,
        k.shape[0], scale, torch.get_num_threads(),
    )  # fmt: skip
    if rc:
        raise MemoryError(f"native attention: no memory for {h} x {k.shape[0]} scores")
    return out


def attention_decode_fits(hd: int, hdv: int) -> bool:
    """Head dims the native decode attention handles."""
    return hd % 16 == 0 and hdv % 16 == 0 and max(hd, hdv) <= MAX_HEAD_DIM
