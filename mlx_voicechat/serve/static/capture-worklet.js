// Microphone capture: runs at the AudioContext's own rate, resamples to the session's input
// rate with state carried across the 128-sample render blocks, and posts PCM16 packets of
// one model frame (80 ms) with their level. Needs resampler.js added to the worklet first.
class CaptureProcessor extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const { targetRate, frameMs } = options.processorOptions;
    this.resampler = new StreamResampler(sampleRate, targetRate);
    this.frameLength = Math.round((targetRate * frameMs) / 1000);
    this.frame = new Int16Array(this.frameLength);
    this.filled = 0;
    this.sumSquares = 0;
    this.peak = 0;
    this.sending = false;
    this.running = true;
    this.mono = new Float32Array(128);
    this.port.onmessage = (event) => {
      const message = event.data;
      if (message.type === 'send') this.sending = message.value;
      else if (message.type === 'stop') this.running = false;
    };
  }

  process(inputs) {
    const channels = inputs[0];
    if (!channels || channels.length === 0) return this.running;
    const n = channels[0].length;
    if (this.mono.length !== n) this.mono = new Float32Array(n);
    const mono = this.mono;
    mono.set(channels[0]);
    for (let c = 1; c < channels.length; c++) {
      const channel = channels[c];
      for (let i = 0; i < n; i++) mono[i] += channel[i];
    }
    if (channels.length > 1) for (let i = 0; i < n; i++) mono[i] /= channels.length;
    const resampled = this.resampler.process(mono);
    for (let i = 0; i < resampled.length; i++) {
      const s = Math.max(-1, Math.min(1, resampled[i]));
      this.sumSquares += s * s;
      const a = Math.abs(s);
      if (a > this.peak) this.peak = a;
      this.frame[this.filled++] = s < 0 ? Math.round(s * 32768) : Math.round(s * 32767);
      if (this.filled === this.frameLength) this.flush();
    }
    return this.running;
  }

  flush() {
    const rms = Math.sqrt(this.sumSquares / this.frameLength);
    if (this.sending) {
      const pcm = this.frame;
      this.port.postMessage({ type: 'frame', pcm, rms, peak: this.peak, time: currentTime },
        [pcm.buffer]);
      this.frame = new Int16Array(this.frameLength);
    } else {
      this.port.postMessage({ type: 'level', rms, peak: this.peak, time: currentTime });
    }
    this.filled = 0;
    this.sumSquares = 0;
    this.peak = 0;
  }
}

registerProcessor('voicechat-capture', CaptureProcessor);
