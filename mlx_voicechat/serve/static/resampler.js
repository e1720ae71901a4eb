// Streaming band-limited resampler, shared by the capture and playback worklets and the page.
// Loaded as an AudioWorklet module (before the processors that use it) and as a classic
// <script> in the page, so it only defines a global.
//
// Windowed-sinc interpolation at an arbitrary ratio. The filter history and the fractional
// read position are carried across calls, so resampling a stream block by block gives the
// same samples as resampling it in one piece: no seam at block or packet joins.
class StreamResampler {
  constructor(inRate, outRate, zeroCrossings = 12) {
    if (!(inRate > 0) || !(outRate > 0)) {
      throw new Error(`sample rates must be positive, not ${inRate} -> ${outRate}`);
    }
    this.inRate = inRate;
    this.outRate = outRate;
    this.identity = inRate === outRate;
    this.step = inRate / outRate; // input samples advanced per output sample
    // Cutoff as a fraction of the input Nyquist: below the lower of the two Nyquists, with
    // a transition band so the 12-zero-crossing kernel still stops aliases.
    this.cutoff = Math.min(1, outRate / inRate) * 0.92;
    this.half = Math.ceil(zeroCrossings / this.cutoff); // kernel half-width, input samples
    this.resolution = 64; // table points per input sample
    const n = this.half * this.resolution + 2;
    this.table = new Float64Array(n);
    for (let i = 0; i < n; i++) {
      const x = i / this.resolution; // distance in input samples
      const u = Math.min(1, x / this.half);
      const window = 0.42 + 0.5 * Math.cos(Math.PI * u) + 0.08 * Math.cos(2 * Math.PI * u);
      const a = Math.PI * this.cutoff * x;
      const sinc = x === 0 ? 1 : Math.sin(a) / a;
      this.table[i] = this.cutoff * sinc * window;
    }
    this.reset();
  }

  reset() {
    // Start with `half` zeros of history so output sample 0 is aligned with input sample 0.
    this.buf = new Float32Array(Math.max(4096, 4 * this.half));
    this.len = this.half;
    this.pos = this.half; // position of the next output sample, in buffer coordinates
    this.out = new Float32Array(256);
  }

  kernel(d) {
    const x = Math.abs(d) * this.resolution;
    const i = Math.floor(x);
    const f = x - i;
    return this.table[i] + (this.table[i + 1] - this.table[i]) * f;
  }

  // Resample one block; returns a view that is valid until the next call.
  process(input) {
    if (this.identity) return Float32Array.from(input);
    if (this.len + input.length > this.buf.length) {
      const grown = new Float32Array(2 * (this.len + input.length));
      grown.set(this.buf.subarray(0, this.len));
      this.buf = grown;
    }
    this.buf.set(input, this.len);
    this.len += input.length;
    const need = Math.ceil((input.length + 1) / this.step) + 2;
    if (this.out.length < need) this.out = new Float32Array(2 * need);
    const buf = this.buf;
    const half = this.half;
    let produced = 0;
    let pos = this.pos;
    while (Math.floor(pos) + half < this.len) {
      const base = Math.floor(pos);
      let acc = 0;
      for (let k = base - half + 1; k <= base + half; k++) {
        acc += buf[k] * this.kernel(pos - k);
      }
      this.out[produced++] = acc;
      pos += this.step;
    }
    // Keep only the history the next output still reads.
    const keep = Math.floor(pos) - half + 1;
    if (keep > 0) {
      buf.copyWithin(0, keep, this.len);
      this.len -= keep;
      pos -= keep;
    }
    this.pos = pos;
    return this.out.subarray(0, produced);
  }
}

globalThis.StreamResampler = StreamResampler;
