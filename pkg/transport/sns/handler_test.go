package sns_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/aws/aws-lambda-go/events"
	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/transport/sns"
)

func ev(agg string, seq int64) envelope.Envelope {
	id, _ := uuid.NewV7()
	return envelope.Envelope{ID: id.String(), Type: "thing.happened", OccurredAt: time.Now().UTC(), AggregateType: "thing",
		AggregateID: agg, Sequence: seq, SchemaVersion: 1, Payload: json.RawMessage(`{}`)}
}

// effects counts side effects in the database, inside the inbox transaction.
const effectsTable = `CREATE TABLE effects (event_id uuid, aggregate_id text, sequence bigint, n serial)`

func countEffects(t testing.TB, db *pgtest.DB, eventID string) int {
	t.Helper()
	var n int
	if err := db.Pool.QueryRow(context.Background(), "SELECT count(*) FROM effects WHERE event_id = $1", eventID).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func record(ctx context.Context, tx pgx.Tx, e envelope.Envelope) error {
	_, err := tx.Exec(ctx, "INSERT INTO effects (event_id, aggregate_id, sequence) VALUES ($1, $2, $3)", e.ID, e.AggregateID, e.Sequence)
	return err
}

func newDB(t *testing.T) *pgtest.DB {
	db := pgtest.New(t)
	if _, err := db.Pool.Exec(context.Background(), effectsTable); err != nil {
		t.Fatal(err)
	}
	return db
}

// fakeDLQ records dead-lettered messages.
type fakeDLQ struct {
	mu   sync.Mutex
	sent []*sqs.SendMessageInput
	fail bool
}

func (f *fakeDLQ) SendMessage(ctx context.Context, in *sqs.SendMessageInput, _ ...func(*sqs.Options)) (*sqs.SendMessageOutput, error) {
	if f.fail {
		return nil, errors.New("dlq unavailable")
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.sent = append(f.sent, in)
	return &sqs.SendMessageOutput{MessageId: aws.String("dlq-1")}, nil
}

type rec struct {
	id, group string
	body      string // "" = a valid envelope for group/seq
	seq       int64
}

// Behaviour of a test apply: by aggregate id and sequence.
func testApply(ctx context.Context, tx pgx.Tx, e envelope.Envelope) error {
	switch fmt.Sprintf("%s/%d", strings.TrimPrefix(e.AggregateID, "customer-4711-"), e.Sequence) {
	case "A/2", "X/1":
		return errors.New("database busy") // transient
	case "P/1":
		return envelope.Permanent(errors.New("order does not exist"))
	case "Z/1":
		panic("nil map")
	}
	return record(ctx, tx, e)
}

func TestHandlerPartialBatchFailures(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name       string
		records    []rec
		order      inbox.Order
		dlqFails   bool
		wantFailed []string
		wantDLQ    []string // message ids dead-lettered
		wantApply  []string // message ids whose effect happened
	}{
		{
			name:      "all succeed",
			records:   []rec{{id: "1", group: "A", seq: 1}, {id: "2", group: "B", seq: 1}, {id: "3", group: "A", seq: 3}},
			wantApply: []string{"1", "2", "3"},
		},
		{
			name: "failure in the middle blocks the rest of its group only",
			records: []rec{{id: "1", group: "A", seq: 1}, {id: "2", group: "B", seq: 1}, {id: "3", group: "A", seq: 2},
				{id: "4", group: "B", seq: 2}, {id: "5", group: "A", seq: 3}, {id: "6", group: "C", seq: 1}},
			wantFailed: []string{"3", "5"},
			wantApply:  []string{"1", "2", "4", "6"},
		},
		{
			name:       "first record fails: its whole group is reported",
			records:    []rec{{id: "1", group: "X", seq: 1}, {id: "2", group: "X", seq: 2}, {id: "3", group: "X", seq: 3}},
			wantFailed: []string{"1", "2", "3"},
		},
		{
			name:      "relaxed: invalid envelope goes to the DLQ at once; its group continues",
			records:   []rec{{id: "1", group: "I", body: `{"v":1,"id":"nope"}`}, {id: "2", group: "I", seq: 2}},
			order:     inbox.OrderRelaxed,
			wantDLQ:   []string{"1"},
			wantApply: []string{"2"},
		},
		{
			name:      "relaxed: permanent error goes to the DLQ at once; its group continues",
			records:   []rec{{id: "1", group: "P", seq: 1}, {id: "2", group: "P", seq: 2}},
			order:     inbox.OrderRelaxed,
			wantDLQ:   []string{"1"},
			wantApply: []string{"2"},
		},
		{
			name:      "strict: invalid envelope goes to the DLQ at once; its group is held behind it",
			records:   []rec{{id: "1", group: "I", body: `{"v":1,"id":"nope"}`}, {id: "2", group: "I", seq: 2}, {id: "3", group: "J", seq: 1}},
			wantDLQ:   []string{"1", "2"},
			wantApply: []string{"3"},
		},
		{
			name:      "strict: permanent error goes to the DLQ at once; its group is held behind it",
			records:   []rec{{id: "1", group: "P", seq: 1}, {id: "2", group: "Q", seq: 1}, {id: "3", group: "P", seq: 2}, {id: "4", group: "P", seq: 3}},
			wantDLQ:   []string{"1", "3", "4"},
			wantApply: []string{"2"},
		},
		{
			name:       "DLQ unavailable: the record is retried, never lost",
			records:    []rec{{id: "1", group: "P", seq: 1}, {id: "2", group: "P", seq: 2}, {id: "3", group: "Q", seq: 1}},
			dlqFails:   true,
			wantFailed: []string{"1", "2"},
			wantApply:  []string{"3"},
		},
		{
			name:       "panic fails its record, not the batch",
			records:    []rec{{id: "1", group: "Z", seq: 1}, {id: "2", group: "Y", seq: 1}},
			wantFailed: []string{"1"},
			wantApply:  []string{"2"},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			db := newDB(t)
			dlq := &fakeDLQ{fail: tc.dlqFails}
			var metrics inbox.BatchMetrics
			h, err := sns.NewHandler(db.Pool, dlq, testApply, sns.HandlerConfig{Consumer: "c", DLQURL: "dlq-url", Order: tc.order,
				OnBatch: func(m inbox.BatchMetrics) { metrics = m }})
			if err != nil {
				t.Fatal(err)
			}
			var sqsEv events.SQSEvent
			idOf := map[string]string{} // event id -> message id
			for _, r := range tc.records {
				body := r.body
				if body == "" {
					e := ev(r.group, r.seq)
					b, _ := e.Encode()
					body = string(b)
					idOf[e.ID] = r.id
				}
				sqsEv.Records = append(sqsEv.Records, events.SQSMessage{MessageId: r.id, Body: body,
					Attributes: map[string]string{"MessageGroupId": r.group, "ApproximateReceiveCount": "1"}})
			}
			resp, err := h.Handle(context.Background(), sqsEv)
			if err != nil {
				t.Fatal(err)
			}
			var failed []string
			for _, f := range resp.BatchItemFailures {
				failed = append(failed, f.ItemIdentifier)
			}
			if fmt.Sprint(failed) != fmt.Sprint(orEmpty(tc.wantFailed)) {
				t.Errorf("failures %v, want %v", failed, tc.wantFailed)
			}
			var dead []string
			for _, s := range dlq.sent {
				dead = append(dead, aws.ToString(s.MessageDeduplicationId))
				if s.MessageAttributes[sns.AttrErrorReason].StringValue == nil || aws.ToString(s.MessageGroupId) == "" {
					t.Errorf("DLQ message without reason or group: %+v", s)
				}
			}
			if fmt.Sprint(dead) != fmt.Sprint(orEmpty(tc.wantDLQ)) {
				t.Errorf("dead-lettered %v, want %v", dead, tc.wantDLQ)
			}
			rows, _ := db.Pool.Query(context.Background(), "SELECT event_id::text FROM effects ORDER BY n")
			ids, _ := pgx.CollectRows(rows, pgx.RowTo[string])
			var applied []string
			for _, id := range ids {
				applied = append(applied, idOf[id])
			}
			if fmt.Sprint(applied) != fmt.Sprint(orEmpty(tc.wantApply)) {
				t.Errorf("applied %v, want %v", applied, tc.wantApply)
			}
			if metrics.Processed != len(tc.wantApply) || metrics.Records != len(tc.records) {
				t.Errorf("metrics %+v", metrics)
			}
		})
	}
}

func orEmpty(s []string) []string {
	if s == nil {
		return []string{}
	}
	return s
}

func TestHandlerDuplicateInBatchAndMissingID(t *testing.T) {
	t.Parallel()
	db := newDB(t)
	h, _ := sns.NewHandler(db.Pool, &fakeDLQ{}, testApply, sns.HandlerConfig{Consumer: "c", DLQURL: "d"})
	e := ev("D", 1)
	b, _ := e.Encode()
	msg := func(id string) events.SQSMessage {
		return events.SQSMessage{MessageId: id, Body: string(b), Attributes: map[string]string{"MessageGroupId": "D"}}
	}
	resp, err := h.Handle(context.Background(), events.SQSEvent{Records: []events.SQSMessage{msg("1"), msg("2")}})
	if err != nil || len(resp.BatchItemFailures) != 0 || countEffects(t, db, e.ID) != 1 {
		t.Fatalf("same event twice in a batch: %+v %v, effects %d", resp, err, countEffects(t, db, e.ID))
	}
	if _, err := h.Handle(context.Background(), events.SQSEvent{Records: []events.SQSMessage{msg("")}}); err == nil {
		t.Fatal("record without message id: want an error (whole batch retried), never an empty identifier")
	}
}

// The handler applies a batch in one transaction: if its COMMIT fails (here
// a deferred constraint), nothing was applied, every record that ran is
// reported failed, and a redelivery applies each exactly once.
func TestHandlerCommitFailureReportsTheBatch(t *testing.T) {
	t.Parallel()
	db := newDB(t)
	ctx := context.Background()
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE once_per_batch (k int UNIQUE DEFERRABLE INITIALLY DEFERRED)`); err != nil {
		t.Fatal(err)
	}
	breakCommit := true
	apply := func(ctx context.Context, tx pgx.Tx, e envelope.Envelope) error {
		if breakCommit {
			// Fine statement by statement; the second row violates the
			// unique key only when the transaction commits.
			if _, err := tx.Exec(ctx, `INSERT INTO once_per_batch VALUES (1)`); err != nil {
				return err
			}
		}
		return record(ctx, tx, e)
	}
	h, _ := sns.NewHandler(db.Pool, &fakeDLQ{}, apply, sns.HandlerConfig{Consumer: "c", DLQURL: "d"})
	var evs []envelope.Envelope
	var batch events.SQSEvent
	for i, g := range []string{"A", "B", "A"} {
		e := ev(g, int64(i+1))
		evs = append(evs, e)
		b, _ := e.Encode()
		batch.Records = append(batch.Records, events.SQSMessage{MessageId: fmt.Sprint(i), Body: string(b), Attributes: map[string]string{"MessageGroupId": g}})
	}
	var m inbox.BatchMetrics
	h2, _ := sns.NewHandler(db.Pool, &fakeDLQ{}, apply, sns.HandlerConfig{Consumer: "c", DLQURL: "d", OnBatch: func(bm inbox.BatchMetrics) { m = bm }})
	resp, err := h2.Handle(ctx, batch)
	if err != nil || len(resp.BatchItemFailures) != 3 {
		t.Fatalf("commit failure: %+v %v, want all 3 records reported failed", resp, err)
	}
	if m.Processed != 0 || m.Failures[inbox.ClassTransient] != 3 {
		t.Fatalf("metrics after a failed commit: %+v", m)
	}
	var n int
	if err := db.Pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM inbox) + (SELECT count(*) FROM effects)`).Scan(&n); err != nil || n != 0 {
		t.Fatalf("a failed commit left %d inbox/effect rows (%v)", n, err)
	}
	breakCommit = false
	for round := 0; round < 2; round++ { // redelivered, then delivered again
		if resp, err := h.Handle(ctx, batch); err != nil || len(resp.BatchItemFailures) != 0 {
			t.Fatalf("redelivery %d: %+v %v", round, resp, err)
		}
	}
	for _, e := range evs {
		if c := countEffects(t, db, e.ID); c != 1 {
			t.Fatalf("event %s applied %d times, want 1", e.ID, c)
		}
	}
}

// A side effect that swallows an SQL error returns nil but leaves the batch
// transaction aborted. The handler must fail that record (and only roll back
// to its own savepoint), never acknowledge it. Batch [a0:g0, a1:g1, b1:g2]
// with a1 swallowing an error: a1 is reported failed and not applied; a0
// and b1 are applied.
func TestHandlerFailsARecordThatLeftTheTransactionAborted(t *testing.T) {
	t.Parallel()
	db := newDB(t)
	ctx := context.Background()
	a0, a1, b1 := ev("g0", 1), ev("g1", 1), ev("g2", 1)
	apply := func(ctx context.Context, tx pgx.Tx, e envelope.Envelope) error {
		if err := record(ctx, tx, e); err != nil {
			return err
		}
		if e.ID == a1.ID {
			_, _ = tx.Exec(ctx, `SELECT 1/0`) // error swallowed: the transaction is now aborted
		}
		return nil
	}
	h, err := sns.NewHandler(db.Pool, &fakeDLQ{}, apply, sns.HandlerConfig{Consumer: "c", DLQURL: "d"})
	if err != nil {
		t.Fatal(err)
	}
	var batch events.SQSEvent
	for i, e := range []envelope.Envelope{a0, a1, b1} {
		b, _ := e.Encode()
		batch.Records = append(batch.Records, events.SQSMessage{MessageId: fmt.Sprint("m", i), Body: string(b),
			Attributes: map[string]string{"MessageGroupId": e.AggregateID, "ApproximateReceiveCount": "1"}})
	}
	resp, err := h.Handle(ctx, batch)
	if err != nil {
		t.Fatal(err)
	}
	var failed []string
	for _, f := range resp.BatchItemFailures {
		failed = append(failed, f.ItemIdentifier)
	}
	if fmt.Sprint(failed) != "[m1]" {
		t.Errorf("failed %v, want [m1] (the record that left the transaction aborted)", failed)
	}
	for _, c := range []struct {
		e    envelope.Envelope
		want int
	}{{a0, 1}, {a1, 0}, {b1, 1}} {
		if n := countEffects(t, db, c.e.ID); n != c.want {
			t.Errorf("event of %s applied %d times, want %d", c.e.AggregateID, n, c.want)
		}
	}
	var claims int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM inbox WHERE event_id = $1`, a1.ID).Scan(&claims); err != nil || claims != 0 {
		t.Errorf("a1 has %d inbox claims (%v), want 0: it must be delivered again", claims, err)
	}
}
