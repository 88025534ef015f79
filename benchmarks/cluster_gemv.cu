// Probe (benchmarks/cluster_gemv.py): the M = 1 int4 GEMV on quantlab's WNA16 layout
// (kernels/layout.py) with its split-K sum on chip. A thread-block cluster of CL CTAs covers 128
// columns; each of its CL·NW warps takes one K range of them. The partials meet through shared
// memory (the warps of a CTA), then distributed shared memory (the CTAs of the cluster): no
// workspace, no atomics, no arrival counter, and a fixed order of addition (deterministic).
// Session 20 put about 1 µs of the Triton GEMV's gap to the read floor in that global finish.
//
// Codes are read as float32 denormals, as the Triton GEMV's DENORM mode does: the masked bits
// themselves are q·2^(sh−149), and the activations are pre-scaled by 2^(64−sh) in shared
// memory, so each code costs one LOP and one FFMA; Σ(q − z)·x = Σq·x − z·Σx per block.
// Header-free (inline PTX for bf16/fp16, DSMEM and the cluster barrier): NVRTC compiles it
// for sm_90a with -DNW=… -DCL=… -DHALF=0|1.
#ifndef NW
#define NW 4
#endif
#ifndef CL
#define CL 8
#endif
#ifndef HALF
#define HALF 0
#endif
#ifndef FINISH  // 0: for timing only, each CTA stores its own partial (a wrong y), no cluster sum
#define FINISH 1
#endif
typedef unsigned int u32;
typedef unsigned short u16;

__device__ __forceinline__ float to_f(u16 h) {
#if HALF
  float f; asm("{ .reg .f16 t; mov.b16 t, %1; cvt.f32.f16 %0, t; }" : "=f"(f) : "h"(h)); return f;
#else
  return __uint_as_float(((u32)h) << 16);
#endif
}
__device__ __forceinline__ u16 from_f(float f) {
  u16 h;
#if HALF
  asm("{ .reg .f16 t; cvt.rn.f16.f32 t, %1; mov.b16 %0, t; }" : "=h"(h) : "f"(f));
#else
  asm("{ .reg .b16 t; cvt.rn.bf16.f32 t, %1; mov.b16 %0, t; }" : "=h"(h) : "f"(f));
#endif
  return h;
}
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}
__device__ __forceinline__ uint4 ld_u4(const void* p) {
  uint4 r;
  asm("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}
// The activation's factor for stored slot s, 2^(64 − sh): sh is where the slot's code sits in
// the register block_dot masks (slots 5–7 come from the word shifted right by 12).
__device__ __forceinline__ float x_factor(int s) {
  const int sh = s <= 4 ? 4 * s : 4 * s - 12;
  return __uint_as_float((u32)(127 + 64 - sh) << 23);
}
__device__ __forceinline__ uint2 ld_u2(const void* p) {
  uint2 r;
  asm("ld.global.nc.v2.u32 {%0,%1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
  return r;
}
__device__ __forceinline__ u32 smem_addr(const void* p) {
  u32 a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}
__device__ __forceinline__ void st_remote(const float* local, u32 rank, float v) {
  u32 remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_addr(local)), "r"(rank));
  asm volatile("st.shared::cluster.f32 [%0], %1;" :: "r"(remote), "f"(v) : "memory");
}
__device__ __forceinline__ u32 cluster_rank() {
  u32 r; asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r)); return r;
}
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// 4 columns' (q − z)·x over one block of 64 k, before scales: words w[j] = word row j of the
// block, xs = the block's 64 scaled activations in stored order (word j, slot s at 8j + s).
__device__ __forceinline__ void block_dot(const uint4 (&w)[8], const float4* xs, float (&a)[4]) {
  float e[4] = {0.f, 0.f, 0.f, 0.f};
  float o[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    float4 lo = xs[2 * j], hi = xs[2 * j + 1];
    u32 ws[4] = {w[j].x, w[j].y, w[j].z, w[j].w};
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      float& t = (j & 1) ? o[c] : e[c];
      u32 v = ws[c], vh = v >> 12;
      t = fmaf(__uint_as_float(v & 0xFu), lo.x, t);
      t = fmaf(__uint_as_float(v & 0xF0u), lo.y, t);
      t = fmaf(__uint_as_float(v & 0xF00u), lo.z, t);
      t = fmaf(__uint_as_float(v & 0xF000u), lo.w, t);
      t = fmaf(__uint_as_float(v & 0xF0000u), hi.x, t);
      t = fmaf(__uint_as_float(vh & 0xF00u), hi.y, t);
      t = fmaf(__uint_as_float(vh & 0xF000u), hi.z, t);
      t = fmaf(__uint_as_float(vh & 0xF0000u), hi.w, t);
    }
  }
#pragma unroll
  for (int c = 0; c < 4; ++c) a[c] = e[c] + o[c];
}

#ifndef MAXB
#define MAXB 80  // blocks of 64 k one CTA stages (K ≤ 64·MAXB·CL)
#endif

extern "C" __global__ void __cluster_dims__(1, CL, 1) __launch_bounds__(NW * 32)
w4_gemv_cluster(const u16* __restrict__ x, const uint4* __restrict__ qw, const u16* __restrict__ sc,
                const u16* __restrict__ zr, u16* __restrict__ y, int N, int K, int NBLK, int BPG, int NG) {
  __shared__ __align__(16) float xs[MAXB * 64];
  __shared__ float xsum[MAXB];
  __shared__ __align__(16) float red[NW][128];
  __shared__ float gather[CL][128 / CL];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const u32 rank = cluster_rank();
#if FINISH
  cluster_arrive_relaxed();  // waited on before the first remote store: every CTA has started
#endif
  const int P = CL * NW, p = rank * NW + warp;
  const int cb0 = (int)((long)rank * NW * NBLK / P), cb1 = (int)((long)(rank + 1) * NW * NBLK / P);
  const int b0 = (int)((long)p * NBLK / P), b1 = (int)((long)(p + 1) * NBLK / P);
  const int col = blockIdx.x * 128 + 4 * lane;
  const bool on = col < N;
  const int N4 = N >> 2;
  const uint4* wp = qw + (long)b0 * 8 * N4 + (col >> 2);

  uint4 wn[8];
  uint2 sn = make_uint2(0, 0), zn = make_uint2(0, 0);
#pragma unroll
  for (int j = 0; j < 8; ++j) wn[j] = make_uint4(0, 0, 0, 0);
  if (on && b0 < b1) {
#pragma unroll
    for (int j = 0; j < 8; ++j) wn[j] = ld_stream(wp + j * N4);
    const long g = min(b0 / BPG, NG - 1) * (long)N + col;
    sn = ld_u2(sc + g);
    zn = ld_u2(zr + g);
  }

  // The CTA's activations, scaled per stored slot, and each block's plain sum. All loads are
  // issued before any is used (one trip to memory, not one per block), 8 activations a load.
  const int kbeg = 64 * cb0, kend = min(64 * cb1, K);
  constexpr int XLOADS = (MAXB * 8 + NW * 32 - 1) / (NW * 32);
  uint4 xv[XLOADS];
#pragma unroll
  for (int i = 0; i < XLOADS; ++i) {
    const int k8 = kbeg + 8 * (threadIdx.x + i * NW * 32);
    xv[i] = make_uint4(0, 0, 0, 0);
    if (k8 + 8 <= kend) {  // x is 16-byte aligned (the launcher checks)
      xv[i] = ld_u4(x + k8);
    } else if (k8 < kend) {
      u32 h[8];  // the CTA range's end, where K is not a multiple of 8
#pragma unroll
      for (int e = 0; e < 8; ++e) h[e] = k8 + e < kend ? x[k8 + e] : 0;
      xv[i] = make_uint4(h[0] | h[1] << 16, h[2] | h[3] << 16, h[4] | h[5] << 16, h[6] | h[7] << 16);
    }
  }
#pragma unroll
  for (int i = 0; i < XLOADS; ++i) {
    const int r8 = 8 * (threadIdx.x + i * NW * 32);
    const u32 words[4] = {xv[i].x, xv[i].y, xv[i].z, xv[i].w};
    if (r8 < 64 * (cb1 - cb0)) {
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const int r = r8 + e, o = r & 63;  // k = 16d + 2j + h of block r / 64 is slot 4h + d of word j
        const int slot = 4 * (o & 1) + (o >> 4), j = (o & 15) >> 1;
        xs[(r & ~63) + 8 * j + slot] = to_f((u16)(words[e >> 1] >> (16 * (e & 1)))) * x_factor(slot);
      }
    }
  }
  __syncthreads();
  for (int lb = warp; lb < cb1 - cb0; lb += NW) {
    const int s = lane & 7;  // positions lane and lane + 32 hold slot s
    float tot = (xs[lb * 64 + lane] + xs[lb * 64 + lane + 32]) / x_factor(s);
#pragma unroll
    for (int o = 16; o; o >>= 1) tot += __shfl_xor_sync(0xffffffffu, tot, o);
    if (lane == 0) xsum[lb] = tot;
  }
  __syncthreads();

  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  const float4* xs4 = reinterpret_cast<const float4*>(xs);
#pragma unroll 1
  for (int b = b0; b < b1; ++b) {
    uint4 w[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) w[j] = wn[j];
    uint2 s2 = sn, z2 = zn;
    wp += 8 * N4;
    if (on && b + 1 < b1) {
#pragma unroll
      for (int j = 0; j < 8; ++j) wn[j] = ld_stream(wp + j * N4);
      const long g = min((b + 1) / BPG, NG - 1) * (long)N + col;  // K-pad blocks: any scale, x is 0
      sn = ld_u2(sc + g);
      zn = ld_u2(zr + g);
    }
    float part[4];
    block_dot(w, xs4 + (b - cb0) * 16, part);
    const float xb = xsum[b - cb0];
    const u16 sv[4] = {(u16)(s2.x & 0xFFFF), (u16)(s2.x >> 16), (u16)(s2.y & 0xFFFF), (u16)(s2.y >> 16)};
    const u16 zv[4] = {(u16)(z2.x & 0xFFFF), (u16)(z2.x >> 16), (u16)(z2.y & 0xFFFF), (u16)(z2.y >> 16)};
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      float s = to_f(sv[c]), z = to_f(zv[c]);
      acc[c] = fmaf(part[c], s * 0x1p85f, acc[c]);  // 2^(149 − 64): the codes' and x's scales
      acc[c] = fmaf(-z * s, xb, acc[c]);
    }
  }

  *reinterpret_cast<float4*>(&red[warp][4 * lane]) = make_float4(acc[0], acc[1], acc[2], acc[3]);
  __syncthreads();
#if FINISH
  cluster_wait();
  for (int c = threadIdx.x; c < 128; c += NW * 32) {
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) v += red[w][c];
    st_remote(&gather[rank][c % (128 / CL)], c / (128 / CL), v);
  }
  cluster_arrive();
  cluster_wait();
  if (threadIdx.x < 128 / CL) {
    int c = blockIdx.x * 128 + rank * (128 / CL) + threadIdx.x;
    float v = 0.f;
#pragma unroll
    for (int r = 0; r < CL; ++r) v += gather[r][threadIdx.x];
    if (c < N) y[c] = from_f(v);
  }
#else
  if (threadIdx.x < 128 / CL) {  // the same stores as the cluster sum makes, of this CTA's part
    const int c = rank * (128 / CL) + threadIdx.x;
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) v += red[w][c];
    if (blockIdx.x * 128 + c < N) y[blockIdx.x * 128 + c] = from_f(v);
  }
#endif
}
