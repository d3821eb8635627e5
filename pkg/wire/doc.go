// Package wire makes fifobox speak an existing system's message contract:
// a profile, kept as data (profiles/*.json or a file of the user's), says
// what an event's body, headers and properties look like on the wire, which
// broker entities the system's consumers declare (names and arguments
// exactly as their design gives them), and how its ids are written (UUID or
// ULID). Without a profile fifobox publishes its own envelope; a profile
// changes only what goes on the wire, never the outbox, its claim or its
// ordering.
//
// The package is transport-neutral: Mapper.Render turns one claimed outbox
// message into a Message (body, typed headers, message id, timestamp,
// destination, group and deduplication ids), and each transport's publisher
// copies that onto its own API (pkg/transport/amqp, pkg/transport/nats,
// pkg/transport/sns). It imports no broker client.
//
// A profile's body is a JSON template. String values name event fields in
// braces, e.g.
//
//	{"event_id": "{event_id}", "occurred_at": "{occurred_at}", "payload": "{payload}"}
//
// A value that is exactly one field keeps the field's JSON type (numbers
// stay numbers, the payload is inserted as JSON); "{field?}" leaves the
// member out when the field is empty; "{a|b}" takes the first non-empty of
// a and b; any other string is interpolated. The body "{payload}" publishes
// the event's payload as the whole body: the producer wrote the system's
// own message shape, and the profile's keys say where the event id,
// aggregate and type are in it.
//
// Every mistake in a profile is reported by Parse, before anything is
// provisioned or published, with the path of the profile field at fault
// (for example `rabbitmq.headers["x-group-id"]: unknown field {group}`).
package wire
