// @openai/agents-realtime's WebRTC transport in a browser, pointed at `serve` by its base URL
// and a client secret; bundled by tests/serve/test_webrtc_agents_js.py (esbuild) and driven in
// headless Chromium. window.agent holds what the test reads.
import { OpenAIRealtimeWebRTC, RealtimeAgent, RealtimeSession } from '@openai/agents-realtime';

window.agent = { events: [], transcripts: [], error: null, status: 'idle' };

window.startAgent = async (baseUrl, secret) => {
  const agent = new RealtimeAgent({ name: 'Assistant', instructions: 'Be brief.' });
  const transport = new OpenAIRealtimeWebRTC({ baseUrl });
  const session = new RealtimeSession(agent, { transport, model: 'nemotron-voicechat' });
  session.on('transport_event', (event) => {
    window.agent.events.push(event.type);
    if (event.type === 'response.output_audio_transcript.delta') window.agent.transcripts.push(event.delta);
  });
  session.on('error', (e) => { window.agent.error = String((e && e.error && e.error.message) || e.error || e); });
  window.agent.session = session;
  try {
    await session.connect({ apiKey: secret });
    window.agent.status = transport.status;
    window.agent.callId = transport.callId;
  } catch (error) {
    window.agent.error = String(error && error.message ? error.message : error);
  }
};
