package redrive_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/aws/aws-lambda-go/events"
	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/redrive"
	"github.com/fifobox/fifobox/pkg/transport"
	"github.com/fifobox/fifobox/pkg/transport/sns"
)

type countingDLQ struct{ sent int }

func (d *countingDLQ) SendMessage(context.Context, *sqs.SendMessageInput, ...func(*sqs.Options)) (*sqs.SendMessageOutput, error) {
	d.sent++
	return &sqs.SendMessageOutput{MessageId: aws.String("m")}, nil
}

// A hold whose dead-lettered message is gone (purged, expired) would hold
// its group for good: release-holds ends it, audited, for one group or all
// of a consumer's, and the group's next event is applied again.
func TestReleaseHolds(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	for _, r := range [][2]string{{"c", "g1"}, {"c", "g1"}, {"c", "g2"}, {"d", "g1"}} {
		if _, err := db.Pool.Exec(ctx, `INSERT INTO inbox_held (consumer, group_id, message_key, class) VALUES ($1, $2, $3, 'permanent')`,
			r[0], r[1], uuid.NewString()); err != nil {
			t.Fatal(err)
		}
	}
	dlq := &countingDLQ{}
	var applied int
	h, err := sns.NewHandler(db.Pool, dlq, func(context.Context, pgx.Tx, envelope.Envelope) error { applied++; return nil },
		sns.HandlerConfig{Consumer: "c", DLQURL: "d", Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	deliver := func(group string) {
		e := event("order", group, "order.paid")
		e.Sequence = 5
		b, _ := e.Encode()
		if resp, err := h.Handle(ctx, events.SQSEvent{Records: []events.SQSMessage{{MessageId: uuid.NewString(), Body: string(b),
			Attributes: map[string]string{"MessageGroupId": group}}}}); err != nil || len(resp.BatchItemFailures) != 0 {
			t.Fatalf("handle: %+v %v", resp, err)
		}
	}
	deliver("g1")
	if applied != 0 || dlq.sent != 1 {
		t.Fatalf("g1 is held: applied %d, dead-lettered %d", applied, dlq.sent)
	}
	svc, _ := redrive.New(db.Pool, redrive.Config{Logger: quiet})
	if _, err := svc.Execute(ctx, redrive.Command{Operation: redrive.OpReleaseHolds}); err == nil {
		t.Fatal("release-holds without a consumer accepted")
	}
	dry, err := svc.Execute(ctx, redrive.Command{Operation: redrive.OpReleaseHolds, Consumer: "c", DryRun: true})
	if err != nil || dry.Affected != 4 || dry.Aggregates != 2 { // g1 has its two rows and the held g1/5
		t.Fatalf("dry run %+v %v", dry, err)
	}
	res, err := svc.Execute(ctx, redrive.Command{Operation: redrive.OpReleaseHolds, Consumer: "c", Groups: []string{"g1"}, Actor: "test"})
	if err != nil || res.Affected != 3 || res.AuditID == 0 {
		t.Fatalf("release g1: %+v %v", res, err)
	}
	deliver("g1")
	if applied != 1 {
		t.Fatalf("g1 after its release: applied %d, want 1", applied)
	}
	var left int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM inbox_held`).Scan(&left); err != nil || left != 2 {
		t.Fatalf("%d held rows left (%v), want c/g2 and d/g1", left, err)
	}
	audit, _ := redrive.ListAudit(ctx, db.Pool, 5)
	if len(audit) != 2 || audit[0].Operation != redrive.OpReleaseHolds || audit[0].Affected != 3 || !audit[1].DryRun {
		t.Fatalf("audit %+v", audit)
	}
}

// depthsOnly is a transport's operations that report queue figures for
// the consumers it knows, and nothing else.
type depthsOnly struct {
	transport.Operations
	known []string
}

func (d depthsOnly) Depths(_ context.Context, consumers ...string) ([]transport.QueueDepth, error) {
	var out []transport.QueueDepth
	for _, c := range d.known {
		if len(consumers) == 0 || consumers[0] == c {
			out = append(out, transport.QueueDepth{Consumer: c, Ready: 3, DLQ: 1})
		}
	}
	return out, nil
}

// status reads held groups from inbox_held whatever the transport: beside
// a transport's queue figures, and for a consumer holding groups that has
// no queue row (or with no transport configured at all).
func TestStatusShowsHeldGroupsWhateverTheTransport(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	for _, r := range [][2]string{{"a", "g1"}, {"a", "g1"}, {"a", "g2"}, {"b", "g1"}} {
		if _, err := db.Pool.Exec(ctx, `INSERT INTO inbox_held (consumer, group_id, message_key, class) VALUES ($1, $2, $3, 'permanent')`,
			r[0], r[1], uuid.NewString()); err != nil {
			t.Fatal(err)
		}
	}
	type row struct {
		consumer            string
		visible, held, msgs int64
		figures             bool
	}
	for _, tc := range []struct {
		name     string
		ops      transport.Operations
		consumer string
		want     []row
	}{
		{"transport knows a", depthsOnly{known: []string{"a", "c"}}, "", []row{{"a", 3, 2, 3, true}, {"c", 3, 0, 0, true}, {"b", -1, 1, 1, false}}},
		{"one consumer", depthsOnly{known: []string{"a", "c"}}, "a", []row{{"a", 3, 2, 3, true}}},
		{"no transport", nil, "", []row{{"a", -1, 2, 3, false}, {"b", -1, 1, 1, false}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			svc, _ := redrive.New(db.Pool, redrive.Config{Operations: tc.ops, Logger: quiet})
			res, err := svc.Execute(ctx, redrive.Command{Operation: redrive.OpStatus, Consumer: tc.consumer})
			if err != nil {
				t.Fatal(err)
			}
			var got []row
			for _, q := range res.Status.Queues.Consumers {
				got = append(got, row{q.Consumer, q.Visible, q.HeldGroups, q.HeldMessages, q.Error == ""})
			}
			if fmt.Sprint(got) != fmt.Sprint(tc.want) {
				t.Fatalf("queues %+v, want %+v", got, tc.want)
			}
		})
	}
}
