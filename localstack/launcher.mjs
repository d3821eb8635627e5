// Starts the fauxqs SNS/SQS emulator for fifobox on 127.0.0.1 only, with
// request logging off (its CLI binds 0.0.0.0 and logs every request).
//   FIFOBOX_EMULATOR_PORT      port (default 4566, LocalStack's)
//   FIFOBOX_EMULATOR_DATA_DIR  if set, state persists there across restarts
import { startFauxqs } from "fauxqs";

const port = parseInt(process.env.FIFOBOX_EMULATOR_PORT ?? "4566", 10);
const dataDir = process.env.FIFOBOX_EMULATOR_DATA_DIR || undefined;
const server = await startFauxqs({ port, host: "127.0.0.1", logger: false, dataDir });
console.log(`fauxqs listening on http://127.0.0.1:${server.port}${dataDir ? ` (state in ${dataDir})` : ""}`);
for (const sig of ["SIGINT", "SIGTERM"]) {
  process.on(sig, () => process.exit(0));
}
