package redrive_test

import (
	"context"
	"encoding/json"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/aws/aws-lambda-go/lambda"
	"github.com/aws/aws-lambda-go/lambdacontext"

	lambdaredrive "github.com/fifobox/fifobox/pkg/lambdafn/redrive"
	"github.com/fifobox/fifobox/pkg/redrive"
)

type recorder struct{ got []redrive.Command }

func (r *recorder) Execute(_ context.Context, cmd redrive.Command) (redrive.Result, error) {
	r.got = append(r.got, cmd)
	return redrive.Result{Operation: cmd.Operation}, nil
}

func TestHandleFillsWhatTheInvocationKnows(t *testing.T) {
	lambdacontext.FunctionName = "fifobox-redrive"
	t.Cleanup(func() { lambdacontext.FunctionName = "" })
	inLambda := lambdacontext.NewContext(context.Background(), &lambdacontext.LambdaContext{AwsRequestID: "req-1"})
	tests := []struct {
		name      string
		ctx       context.Context
		def       string
		cmd       redrive.Command
		wantOp    string
		wantActor string
		wantReqID string
	}{
		{"deploy trigger: empty event takes the default", inLambda, "migrate", redrive.Command{}, "migrate", "lambda:fifobox-redrive", "req-1"},
		{"the event's operation wins over the default", inLambda, "migrate", redrive.Command{Operation: "status"}, "status", "lambda:fifobox-redrive", "req-1"},
		{"the payload's actor is recorded as claimed", inLambda, "", redrive.Command{Operation: "requeue-dead", Actor: "ana@laptop"}, "requeue-dead", "claimed:ana@laptop", "req-1"},
		{"a payload cannot pose as the function", inLambda, "", redrive.Command{Operation: "status", Actor: "lambda:fifobox-redrive"}, "status", "claimed:lambda:fifobox-redrive", "req-1"},
		{"the request id is the Lambda's, not the caller's", inLambda, "", redrive.Command{Operation: "status", RequestID: "forged"}, "status", "lambda:fifobox-redrive", "req-1"},
		{"outside Lambda the caller's request id stays", context.Background(), "", redrive.Command{Operation: "status", RequestID: "local"}, "status", "lambda:fifobox-redrive", "local"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			rec := &recorder{}
			h, err := lambdaredrive.New(rec, lambdaredrive.Config{DefaultOperation: tt.def})
			if err != nil {
				t.Fatal(err)
			}
			if _, err := h.Handle(tt.ctx, tt.cmd); err != nil {
				t.Fatal(err)
			}
			got := rec.got[0]
			if got.Operation != tt.wantOp || got.Actor != tt.wantActor || got.RequestID != tt.wantReqID {
				t.Errorf("ran %+v, want operation %q actor %q request id %q", got, tt.wantOp, tt.wantActor, tt.wantReqID)
			}
		})
	}
}

func TestDefaultOperationIsCheckedAtInit(t *testing.T) {
	tests := []struct {
		env     string
		wantErr string // "" = valid
	}{
		{"", ""},
		{"migrate", ""},
		{"prune", ""},
		{"migrat", `FIFOBOX_DEFAULT_OPERATION: operation: unknown operation "migrat"`},
		{"Migrate", `FIFOBOX_DEFAULT_OPERATION: operation: unknown operation "Migrate"`},
	}
	for _, tt := range tests {
		t.Run(tt.env, func(t *testing.T) {
			t.Setenv("FIFOBOX_DEFAULT_OPERATION", tt.env)
			c, err := lambdaredrive.ConfigFromEnv()
			if tt.wantErr == "" {
				if err != nil || c.DefaultOperation != tt.env {
					t.Fatalf("ConfigFromEnv() = %+v, %v; want DefaultOperation %q", c, err, tt.env)
				}
				return
			}
			if err == nil || !strings.HasPrefix(err.Error(), tt.wantErr) || !strings.Contains(err.Error(), "dlq-discard") {
				t.Fatalf("ConfigFromEnv() error %v, want it to start %q and list the operations", err, tt.wantErr)
			}
		})
	}
	if _, err := lambdaredrive.New(&recorder{}, lambdaredrive.Config{DefaultOperation: "nope"}); err == nil || !strings.Contains(err.Error(), "DefaultOperation") {
		t.Fatalf("New with a bad default: %v, want an error naming DefaultOperation", err)
	}
	if _, err := lambdaredrive.New(nil, lambdaredrive.Config{}); err == nil {
		t.Fatal("New(nil) succeeded")
	}
}

// The daily retention schedule (infra/stacks/stateless.go, RetentionSchedule)
// invokes the function with this JSON, written out by hand in the CDK
// module: it must decode into the prune it means.
func TestRetentionSchedulePayloadDecodes(t *testing.T) {
	const payload = `{"operation":"prune","actor":"schedule:retention","older_than":"168h","inbox_older_than":"720h"}`
	cmd, err := redrive.DecodeCommand([]byte(payload), "")
	if err != nil {
		t.Fatalf("decode %s: %v", payload, err)
	}
	want := redrive.Command{Operation: redrive.OpPrune, Actor: "schedule:retention",
		OlderThan: redrive.Duration(7 * 24 * time.Hour), InboxOlderThan: redrive.Duration(30 * 24 * time.Hour)}
	if !reflect.DeepEqual(cmd, want) {
		t.Errorf("decoded %+v, want %+v", cmd, want)
	}
}

// The deploy-time migration (a CDK Trigger) invokes the function with no
// payload of its own: through the same path lambda.Start uses, an empty,
// blank, {} or null payload runs the default operation; a misspelt field
// is refused, naming it.
func TestDeployTriggerPayloadsThroughTheLambdaHandler(t *testing.T) {
	inLambda := lambdacontext.NewContext(context.Background(), &lambdacontext.LambdaContext{AwsRequestID: "req-9"})
	for _, payload := range []string{"", " \n", "{}", "null"} {
		rec := &recorder{}
		h, err := lambdaredrive.New(rec, lambdaredrive.Config{DefaultOperation: redrive.OpMigrate})
		if err != nil {
			t.Fatal(err)
		}
		out, err := lambda.NewHandler(h).Invoke(inLambda, []byte(payload))
		if err != nil {
			t.Fatalf("payload %q: %v", payload, err)
		}
		var res redrive.Result
		if err := json.Unmarshal(out, &res); err != nil || res.Operation != redrive.OpMigrate {
			t.Fatalf("payload %q: response %s (%v), want the migrate result", payload, out, err)
		}
		if len(rec.got) != 1 || rec.got[0].Operation != redrive.OpMigrate || rec.got[0].RequestID != "req-9" {
			t.Fatalf("payload %q ran %+v", payload, rec.got)
		}
	}
	h, _ := lambdaredrive.New(&recorder{}, lambdaredrive.Config{DefaultOperation: redrive.OpMigrate})
	if _, err := lambda.NewHandler(h).Invoke(inLambda, []byte(`{"operation":"prune","older_tham":"1h"}`)); err == nil || !strings.Contains(err.Error(), "older_tham") {
		t.Fatalf("misspelt field: %v, want an error naming it", err)
	}
}
