// Package seeds runs the existing systems' own clients against fifobox:
// for each design in the seeds (000 HoldCo, 001 corebilling, 002
// corewrite, 003 ticketing, 004 transfers), its topology declares and its
// consumer code, written from the document alone with the client library
// that system uses (amqplib, nats.go, pika, boto3), consume what fifobox
// publishes through the system's wire profile (profiles/*.json). Their
// producers are unchanged too: each test writes its events as the
// document's producer does, into the system's own outbox table
// (examples/seeds/<system>/outbox.sql; 004's wire-test SQL verbatim) in a
// schema of its own, and fifobox delivers those rows through the profile's
// source section (pkg/capture), checking the table's status columns. The tests
// check that every event is applied once and in order, and that the
// document's retry and dead-letter path behaves as the document says.
//
// The Node and Python clients live in examples/seeds (scripts/test.sh
// installs them: npm ci there; Debian's python3-pika, python3-psycopg and
// python3-boto3). A test whose client is missing skips, naming it, unless
// FIFOBOX_REQUIRE_CLIENTS=1 makes that a failure.
package seeds
