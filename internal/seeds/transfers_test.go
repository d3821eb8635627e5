package seeds_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/google/uuid"

	"github.com/fifobox/fifobox/internal/emulatortest"
	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/transport/sns"
	"github.com/fifobox/fifobox/pkg/wire"
)

// transfers (seeds/004): the design's consumer mock (boto3), as written,
// reads each SQS message's body['Message'] (SNS-envelope delivery, which
// the profile sets for its subscriptions) and prints the envelope's type
// and eventId. Every event reaches it once, in order per transfer
// (MessageGroupId = key.transferId, MessageDeduplicationId =
// envelope.eventId). A consumer following the design's flowchart that
// fails an event and does not acknowledge it leaves it to SQS: retried,
// then moved to the queue's DLQ, while other transfers go on.
func TestTransfersConsumerMockUnchanged(t *testing.T) {
	t.Parallel()
	py := python(t, "boto3")
	ctx := context.Background()
	prof := load(t, "transfers")
	for i := range prof.SNS.Subscriptions {
		prof.SNS.Subscriptions[i].MaxReceiveCount = 2
	}
	env := emulatortest.New(t, prof.SNS.Topology(), 2)
	db := pgtest.New(t)

	type event struct {
		id, transfer string
		n            int
	}
	// The producers' schema: the document's wire-test SQL as written (its
	// table, and a first event written before fifobox delivered the table,
	// which stays the old dispatcher's), then fifobox's capture.
	app := producers(t, db, prof, "transfers", "wire_test.sql")
	var events []event
	var doomed event
	for tr := 0; tr < 3; tr++ {
		transfer := fmt.Sprintf("tr_%d_%s", tr, uuid.NewString()[:8])
		for n, typ := range []string{"submitted.usdc", "accepted", "settled", "ledger.posted"} {
			e := event{id: uuid.NewString(), transfer: transfer, n: n + 1}
			events = append(events, e)
			if tr == 1 && n == 1 {
				doomed = e
			}
			// The document's producer write (its wire test's insert, with
			// this event's ids), into its own outbox table.
			if _, err := app.Pool.Exec(ctx, `INSERT INTO outbox (id, eventType, payload)
VALUES (
  gen_random_uuid(),
  $1,
  jsonb_build_object(
    'envelope', jsonb_build_object('v',1,'eventId', $2::text, 'occurredAt', now(), 'tenantId','tnt_demo','type',$1::text),
    'key', jsonb_build_object('transferId',$3::text),
    'payload', jsonb_build_object('amount', jsonb_build_object('value','10.00','currency','USD'), 'n', $4::int)
  )
)`, "events.transfers."+typ, e.id, transfer, e.n); err != nil {
				t.Fatal(err)
			}
		}
	}
	// The wire test's SQL, copied from the document, run again now that
	// fifobox delivers the table: its event (a fresh eventId for
	// tr_test_123) is delivered like the others.
	wireTest, err := os.ReadFile(filepath.Join(clientsDir(), "transfers", "wire_test.sql"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := app.Pool.Exec(ctx, string(wireTest)); err != nil {
		t.Fatalf("the document's wire-test SQL: %v", err)
	}
	var seeded string
	if err := app.Pool.QueryRow(ctx, `SELECT payload #>> '{envelope,eventId}' FROM outbox WHERE payload #>> '{key,transferId}' = 'tr_test_123' ORDER BY createdAt DESC LIMIT 1`).Scan(&seeded); err != nil {
		t.Fatal(err)
	}
	events = append(events, event{id: seeded, transfer: "tr_test_123", n: 1})
	dir := filepath.Join(clientsDir(), "transfers")
	awsEnv := []string{"AWS_ENDPOINT_URL=" + env.Endpoint, "AWS_REGION=us-east-1", "AWS_ACCESS_KEY_ID=test", "AWS_SECRET_ACCESS_KEY=test"}
	mock := start(t, dir, append(awsEnv, "QUEUE_URL="+env.Queues["gateway-usdc"].URL), false, py, "-u", "run.py", "consumer_mock.py")
	failing := start(t, dir, append(awsEnv, "QUEUE_URL="+env.Queues["ledger-postings"].URL, "FAIL_EVENT_IDS="+doomed.id), true,
		py, "-u", "run.py", "failing_consumer.py")

	pub, err := sns.NewPublisher(env.SNS, sns.PublisherConfig{TopicARN: env.TopicARN, Wire: mapper(t, prof, wire.TransportSNS)})
	if err != nil {
		t.Fatal(err)
	}
	dispatch(t, db, pub)

	eventually(t, 2*time.Minute, "the mock printed every event", func() bool { return len(mock.output()) >= len(events) })
	eventually(t, 2*time.Minute, "the failing consumer applied the rest", func() bool { return len(failing.output()) >= len(events)-1 })
	time.Sleep(2 * time.Second) // a duplicate would arrive now

	byID := map[string]event{}
	for _, e := range events {
		byID[e.id] = e
	}
	check := func(who string, ids []string, skip string) {
		seen := map[string]bool{}
		last := map[string]int{}
		for _, id := range ids {
			e, ok := byID[id]
			if !ok || seen[id] {
				t.Errorf("%s: %s unknown or twice", who, id)
				continue
			}
			seen[id] = true
			if e.transfer != doomed.transfer || skip == "" {
				if e.n != last[e.transfer]+1 {
					t.Errorf("%s: transfer %s: event %d after %d", who, e.transfer, e.n, last[e.transfer])
				}
				last[e.transfer] = e.n
			}
		}
		want := len(events)
		if skip != "" {
			want--
			if seen[skip] {
				t.Errorf("%s applied %s, whose side effect always fails", who, skip)
			}
		}
		if len(seen) != want {
			t.Errorf("%s applied %d events, want %d", who, len(seen), want)
		}
	}
	var got []string
	for _, line := range mock.output() {
		f := strings.Fields(line)
		if len(f) != 5 || f[0] != "Got" || f[1] != "event" || !strings.HasPrefix(f[2], "events.transfers.") {
			t.Fatalf("the mock printed %q", line)
		}
		got = append(got, f[3])
	}
	check("consumer mock", got, "")
	got = nil
	for _, line := range failing.output() {
		f := strings.Fields(line)
		if len(f) != 3 || byID[f[2]].transfer != f[1] {
			t.Fatalf("the failing consumer printed %q", line)
		}
		got = append(got, f[2])
	}
	check("failing consumer", got, doomed.id)

	// The table's state column tells the truth: every delivered row SENT,
	// after one attempt; the row written before the capture untouched.
	eventually(t, 30*time.Second, "every delivered outbox row SENT", func() bool {
		var sent, pending int
		_ = app.Pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE state = 'SENT' AND attempts = 1), count(*) FILTER (WHERE state = 'PENDING') FROM outbox`).Scan(&sent, &pending)
		return sent == len(events) && pending == 1
	})

	out, err := env.SQS.ReceiveMessage(ctx, &sqs.ReceiveMessageInput{QueueUrl: aws.String(env.Queues["ledger-postings"].DLQURL),
		MaxNumberOfMessages: 10, WaitTimeSeconds: 5})
	if err != nil {
		t.Fatal(err)
	}
	if len(out.Messages) != 1 {
		t.Fatalf("ledger-postings DLQ holds %d messages, want the failing event", len(out.Messages))
	}
	var note struct{ Type, Message string }
	var body struct {
		Envelope map[string]any `json:"envelope"`
		Key      map[string]any `json:"key"`
	}
	if err := json.Unmarshal([]byte(aws.ToString(out.Messages[0].Body)), &note); err != nil || note.Type != "Notification" {
		t.Fatalf("dead letter is not SNS's notification: %v %s", err, aws.ToString(out.Messages[0].Body))
	}
	if err := json.Unmarshal([]byte(note.Message), &body); err != nil || body.Envelope["eventId"] != doomed.id || body.Key["transferId"] != doomed.transfer {
		t.Errorf("dead letter carries %s", note.Message)
	}
}
