// Package nats is fifobox's NATS JetStream transport, on the official
// client (github.com/nats-io/nats.go and its jetstream package). It works
// with NATS Server 2.9 and later. It implements pkg/transport's four parts:
//
//   - Publisher (outbox.Publisher): one message per event on
//     "<prefix>.<subject template>" (e.g. "billing.invoice.paid"; field
//     values sanitised to one token each), Nats-Msg-Id = event id so the
//     stream's duplicate window drops a republish, Nats-Expected-Stream so a
//     subject captured by another stream is refused, fifobox headers (event
//     id, type, aggregate, sequence, tenant, traceparent). Each Publish call
//     publishes its messages asynchronously and then waits for every PubAck:
//     nil only once the stream stored the message (or acknowledged it as a
//     duplicate of a stored one). Outcomes: retryable ErrNoAck (timeout,
//     connection lost, no leader), ErrNoStream (stream missing), ErrRefused
//     (stream full, other API errors), ErrUnavailable (no connection);
//     permanent ErrTooLarge, ErrWrongStream, ErrSubjectNotBound, ErrSubject.
//   - Provisioner: the Topology as data: the events stream (file storage,
//     replicas, interest retention, discard-new, a duplicate window checked
//     against the dispatcher's lease and backoff ceiling), a dead-letter
//     stream, and one durable pull consumer per subscriber with its filter
//     subjects, AckWait, MaxAckPending and MaxDeliver. Idempotent; an
//     existing stream or consumer with other settings is reported
//     (ErrTopologyConflict naming every difference), never changed.
//   - Runner: pulls its consumer's messages, applies each through the inbox
//     (transport.ProcessEnvelope) on its aggregate's lane (transport.Lanes)
//     and acknowledges only after the inbox committed. Transient failures
//     are nacked with the RetryPolicy's delay (NakWithDelay) while the
//     aggregate's later messages are held in memory behind them; once the
//     retries are used up, and at once for invalid or permanently failing
//     messages, the message is published to the dead-letter stream with the
//     reason and then terminated.
//   - Operations: per-consumer depths (pending, ack-pending, redelivered,
//     dead letters), redrive from the dead-letter stream in the order the
//     messages died, and replay to one consumer through its own replay
//     subject.
//
// Holdco, Ticketing and Corewrite are example topologies; FromTopology maps
// fifobox's own pkg/topology onto subjects. docs/transports-nats.md has the
// whole picture.
//
// The package name is its directory's; code that also imports the client
// aliases it (natsgo "github.com/nats-io/nats.go"), as this package does.
package nats
