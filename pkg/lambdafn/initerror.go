package lambdafn

import (
	"bytes"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"time"

	"github.com/fifobox/fifobox/pkg/envspec"
)

// Env is what this package reads itself: the Runtime API's address, set by
// Lambda (pkg/db, pkg/awsclient and pkg/metrics declare their own).
var Env = envspec.Set{
	{Name: "AWS_LAMBDA_RUNTIME_API", Reserved: true, Doc: "host:port of the Lambda Runtime API (set by Lambda)"},
}

// InitError is the error type reported to the Runtime API for a failed init
// (Lambda-Runtime-Function-Error-Type and the body's errorType).
const InitError = "Runtime.InitError"

// InitFailed ends a function whose init failed: it logs err, reports it to
// the Lambda Runtime API's init-error endpoint (so the invocation that
// started the execution environment fails with this message, not with
// "Runtime exited with error: exit status 1"), and exits with status 1.
// Outside Lambda (no AWS_LAMBDA_RUNTIME_API) it only logs and exits.
func InitFailed(log *slog.Logger, function string, err error) {
	msg := function + " init: " + err.Error()
	log.Error(function+" init failed", "error", err.Error())
	if api := Env.Get("AWS_LAMBDA_RUNTIME_API"); api != "" {
		if rerr := postInitError(api, msg); rerr != nil {
			log.Error("report init error to the runtime API failed", "error", rerr.Error())
		}
	}
	os.Exit(1)
}

// postInitError posts the standard Lambda error document
// ({"errorMessage", "errorType", "stackTrace"}) to /runtime/init/error.
func postInitError(api, msg string) error {
	body, err := json.Marshal(map[string]any{"errorMessage": msg, "errorType": InitError, "stackTrace": []string{}})
	if err != nil {
		return err
	}
	req, err := http.NewRequest(http.MethodPost, "http://"+api+"/2018-06-01/runtime/init/error", bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/vnd.aws.lambda.error+json")
	req.Header.Set("Lambda-Runtime-Function-Error-Type", InitError)
	resp, err := (&http.Client{Timeout: 5 * time.Second}).Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusAccepted {
		return fmt.Errorf("init/error answered %s", resp.Status)
	}
	return nil
}
