// Package redrive is the redrive (operations) Lambda's handler. It runs a
// redrive.Command after filling in what the invocation knows and its JSON
// may not say: the default operation (a CDK deploy trigger cannot choose its
// payload), the Lambda request id, and the function as actor.
package redrive

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/aws/aws-lambda-go/lambdacontext"

	"github.com/fifobox/fifobox/pkg/envspec"
	"github.com/fifobox/fifobox/pkg/redrive"
)

// Executor runs one command; *redrive.Service satisfies it.
type Executor interface {
	Execute(ctx context.Context, cmd redrive.Command) (redrive.Result, error)
}

// Config configures the handler.
type Config struct {
	// DefaultOperation runs when the event names none. Empty: the event
	// must name one.
	DefaultOperation string
}

// Validate reports the first invalid field.
func (c Config) Validate() error {
	if err := c.checkDefault(); err != nil {
		return fmt.Errorf("DefaultOperation: %w", err)
	}
	return nil
}

func (c Config) checkDefault() error {
	if c.DefaultOperation == "" {
		return nil
	}
	return redrive.CheckOperation(c.DefaultOperation)
}

// Env is every variable ConfigFromEnv reads (declare a new one here; the
// runtime contract tests check the CDK template against this list). The
// transport's (FIFOBOX_QUEUES for sns) are transport.RegisteredEnv's.
var Env = envspec.Set{
	{Name: "FIFOBOX_DEFAULT_OPERATION", Doc: "operation run when the event names none (the deploy trigger's migrate)"},
}

// ConfigFromEnv reads FIFOBOX_DEFAULT_OPERATION and checks it names an
// operation, so a typo fails the function's init, not the deploy trigger.
func ConfigFromEnv() (Config, error) {
	c := Config{DefaultOperation: Env.Get("FIFOBOX_DEFAULT_OPERATION")}
	if err := c.checkDefault(); err != nil {
		return c, fmt.Errorf("FIFOBOX_DEFAULT_OPERATION: %w", err)
	}
	return c, nil
}

// Handler runs operator commands. Build it once at init and register Handle
// with lambda.Start.
type Handler struct {
	svc Executor
	cfg Config
}

// New returns a Handler.
func New(svc Executor, cfg Config) (*Handler, error) {
	if svc == nil {
		return nil, errors.New("new redrive handler: executor is required")
	}
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("new redrive handler: %w", err)
	}
	return &Handler{svc: svc, cfg: cfg}, nil
}

// Handle runs cmd. The audit row records the Lambda request id, and as
// actor the function ("lambda:<name>") or, if the payload names one (the CLI
// sends user@host), that name marked as claimed ("claimed:user@host"):
// anyone allowed to invoke the function can write any actor, so only the
// request id (matched in CloudTrail) says who really asked.
func (h *Handler) Handle(ctx context.Context, cmd redrive.Command) (redrive.Result, error) {
	if cmd.Operation == "" {
		cmd.Operation = h.cfg.DefaultOperation
	}
	if lc, ok := lambdacontext.FromContext(ctx); ok {
		cmd.RequestID = lc.AwsRequestID
	}
	if cmd.Actor == "" {
		cmd.Actor = "lambda:" + lambdacontext.FunctionName
	} else {
		cmd.Actor = redrive.ClaimedActorPrefix + cmd.Actor
	}
	return h.svc.Execute(ctx, cmd)
}

// Invoke makes Handler a lambda.Handler (register it with lambda.Start(h)):
// it decodes the payload with redrive.DecodeCommand, the decoder the CLI
// uses too (the operations and arguments of redrive.Ops, durations in
// seconds or as "24h"/"7d", times as RFC 3339, a date or a duration ago),
// and runs Handle. An empty payload (a CDK trigger may invoke with none)
// or JSON null runs the default operation. A field the operation does not
// take is refused, naming the field, so a misspelt option is never
// silently ignored.
func (h *Handler) Invoke(ctx context.Context, payload []byte) ([]byte, error) {
	cmd, err := redrive.DecodeCommand(payload, h.cfg.DefaultOperation)
	if err != nil {
		return nil, fmt.Errorf("redrive command: %w", err)
	}
	res, err := h.Handle(ctx, cmd)
	if err != nil {
		return nil, err
	}
	return json.Marshal(res)
}
