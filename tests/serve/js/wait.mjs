// What both client scripts wait with: a pause, and a condition polled until a deadline.
export const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

export async function until(what, test, ms) {
  const end = Date.now() + ms;
  while (!test()) {
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
    await sleep(20);
  }
}
